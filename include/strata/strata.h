/* strata.h: Strata's public C API, the one stable contract. A trainer embeds
 * the engine through it: register parameters in groups, fetch each group
 * before it computes, hand its gradients back, and step the optimizer whose
 * fp32 state lives in the device / host / NVMe tiers. C99 and C++.
 *
 * Example (errors: every call returns a strata_status_t):
 *
 *   strata_engine_t* e = NULL;
 *   if (strata_engine_create(json, NULL, &e) != STRATA_OK) {  // e is left NULL
 *     fprintf(stderr, "%s\n", strata_last_error());
 *     return 1;
 *   }
 *   uint64_t off;
 *   const int64_t dims[2] = {rows, cols};
 *   strata_engine_add_param_shaped(e, 0, "blk0.w", 2, dims, w_init, &off);  // ... every tensor
 *   strata_engine_build(e);
 *   for (int step = 0; step < steps; ++step) {
 *     void* p;
 *     uint64_t span;
 *     strata_engine_span_begin(e, "fwd+bwd", &span);  // in the trace, if configured
 *     strata_engine_fetch(e, 0, stream, &p);   // group 0 in the compute dtype
 *     ... forward and backward with p ...
 *     strata_engine_span_end(e, span);
 *     strata_engine_release(e, 0, stream);
 *     strata_engine_grads(e, 0, grads, STRATA_DTYPE_F32, stream);
 *     strata_step_options_t opt = STRATA_STEP_OPTIONS_INIT;
 *     opt.lr = lr_at(step);
 *     strata_step_result_t res = STRATA_STEP_RESULT_INIT;
 *     strata_engine_step(e, &opt, &res);
 *   }
 *   strata_engine_destroy(e);
 *
 * Conventions, for every function below:
 *   - No exception and no abort crosses this boundary for bad input; a call
 *     returns a status and strata_last_error() gives the detailed message.
 *   - Pointers named out* are written only on STRATA_OK.
 *   - After an internal error (STRATA_INTERNAL) an engine is broken: every
 *     later call on it returns STRATA_STATE and says why; only
 *     strata_engine_destroy still works. A step that cannot be finished
 *     (see strata_engine_step) also breaks it, but there a checkpoint load
 *     brings it back.
 *   - Process-wide: the first engine sets SIGXFSZ to ignored where it had
 *     its default action (a swap file past RLIMIT_FSIZE is then NOSPACE,
 *     not a kill), and with several ranks SIGPIPE likewise (a write to a
 *     peer that died is then COMM); programs a child executes inherit both.
 *     The engine's threads are started with the creating thread's signal
 *     mask: block the signals a program waits for with sigwait or signalfd
 *     before strata_engine_create.
 *   - An engine works only in the process that created it: in a child of
 *     fork every call on it returns STRATA_STATE, naming both processes,
 *     and strata_engine_destroy does nothing. The child may create its own.
 *   - One thread at a time drives an engine (the caller serializes); distinct
 *     engines may be driven from distinct threads. (The trace calls,
 *     strata_engine_span_begin/_end and strata_engine_write_trace, are the
 *     exception: any thread, any time.) The engine runs its own I/O,
 *     copy and prefetch threads internally.
 *   - Warnings and notes go to stderr as "[strata W] ..." lines. The
 *     environment variable STRATA_LOG_LEVEL (trace, debug, info, warning or
 *     warn, error or err, critical, off; lower case) sets the level, read once
 *     when the library first logs; unset or empty means info, and any other
 *     value is named in a warning and info is kept.
 *   - Option and result structs start with struct_size, which the caller sets
 *     (the _INIT macros do): the library reads and writes only the fields that
 *     struct_size covers, so programs built against an older header keep
 *     working; fields are only ever appended.
 */
#ifndef STRATA_STRATA_H_
#define STRATA_STRATA_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(STRATA_BUILDING_LIBRARY) && defined(__GNUC__)
#define STRATA_API __attribute__((visibility("default")))
#else
#define STRATA_API
#endif

/* ---- Version ------------------------------------------------------------ */

#define STRATA_VERSION_MAJOR 0
#define STRATA_VERSION_MINOR 1
#define STRATA_VERSION_PATCH 0
/* MAJOR * 10000 + MINOR * 100 + PATCH, as strata_version() returns it. */
#define STRATA_VERSION_CODE (STRATA_VERSION_MAJOR * 10000 + STRATA_VERSION_MINOR * 100 + STRATA_VERSION_PATCH)

/* The version of the library loaded at run time, coded as STRATA_VERSION_CODE.
 * Thread-safe. */
STRATA_API int strata_version(void);

/* ---- Status ------------------------------------------------------------- */

typedef enum strata_status {
  STRATA_OK = 0,
  STRATA_INVALID = 1,     /* bad argument (null pointer, unknown group, size) */
  STRATA_CONFIG = 2,      /* bad configuration key or value */
  STRATA_NOMEM = 3,       /* a budget or the OS refused memory */
  STRATA_IO = 4,          /* an I/O call failed */
  STRATA_NOSPACE = 5,     /* disk full or file too large */
  STRATA_CORRUPT = 6,     /* checksum mismatch, truncated file */
  STRATA_COMM = 7,        /* a collective or the rendezvous store failed */
  STRATA_TIMEOUT = 8,     /* a wait ran past its limit */
  STRATA_UNSUPPORTED = 9, /* not available in this build or on this machine */
  STRATA_STATE = 10,      /* call out of order, or the engine is broken */
  STRATA_INTERNAL = 11,   /* a bug in Strata */
  STRATA_NOT_FOUND = 12   /* nothing there: no checkpoint saved yet in the folder, or no such tag */
} strata_status_t;

/* "OK", "INVALID", ... ; "UNKNOWN" for a value outside the enum. The string
 * is static. Thread-safe. */
STRATA_API const char* strata_status_name(strata_status_t status);

/* The message of the latest call on THIS thread that did not return
 * STRATA_OK ("" when none has failed yet); successful calls leave it as it
 * is, but one: strata_engine_takes_grad_parts sets it to why not when it
 * answers 0. Owned by the library, valid until the next strata_* call on the same
 * thread. Never NULL. */
STRATA_API const char* strata_last_error(void);

/* ---- This machine's memory ---------------------------------------------- */

/* The host memory the engine's "auto" budgets start from, before there is an
 * engine: `bytes_out`, what this process may use (physical RAM, or less where
 * the tightest cgroup memory limit on its cgroup's path up says so: a
 * container's, a job's); `local_ranks_out`, the ranks that the launcher's
 * variables put on this host (torchrun's LOCAL_WORLD_SIZE, OpenMPI's,
 * Slurm's; 1 without a launcher). strata.host_budget "auto" is half of the
 * memory, shared by the ranks on the host (an engine counts them itself at
 * create: the ranks with the same boot id and limiting cgroup). For a
 * trainer that sizes what it registers (strata.torch's OffloadAdam buckets)
 * by the budget the engine will have. Either pointer may be NULL.
 * Errors: INVALID (the launcher's variables, as strata_rank_from_env).
 * Thread-safe. */
STRATA_API strata_status_t strata_host_memory(uint64_t* bytes_out, int* local_ranks_out);

/* ---- Element types ------------------------------------------------------ */

typedef enum strata_dtype {
  STRATA_DTYPE_F32 = 0,
  STRATA_DTYPE_BF16 = 1,
  STRATA_DTYPE_F16 = 2
} strata_dtype_t;

/* ---- Engine ------------------------------------------------------------- */

/* Opaque. Created by strata_engine_create, freed by strata_engine_destroy. */
typedef struct strata_engine strata_engine_t;

typedef struct strata_engine_options {
  size_t struct_size;
  int rank;                    /* this process's rank, 0-based */
  int world_size;              /* ranks sharing the model; 0 (the default): from
                                  the launcher's variables (torchrun, else
                                  OpenMPI, else Slurm), one rank when none is
                                  set; 1: alone, whatever they say */
  int grad_accumulation_steps; /* strata_engine_grads calls per group per step; with
                                  strata.grad_reduce "mean" (the default) the
                                  step divides their sum by this (and by the
                                  world size), as torch DDP with a loss
                                  divided by the accumulation steps */
  int force_no_gpu;            /* nonzero: the device tier is a host arena even with a GPU */
  /* Nonzero: each group is updated as soon as its gradients are complete,
   * overlapping the rest of backward, with bitwise the same result as
   * without. Where the step could still change that update (gradient
   * clipping, fp16 loss scaling, strata.nonfinite "skip"/"error") the early
   * update is speculative: held until strata_engine_step knows the global
   * norm, then committed, or discarded and redone with the clipping
   * coefficient, or discarded when the step is skipped. Its room:
   * strata.speculation_host_bytes and strata.speculation_disk_bytes
   * (docs/config.md); groups that do not fit update after backward. Needs
   * strata_engine_prepare_step before each step's first strata_engine_grads
   * (a step without it is not overlapped). */
  int overlap_step;
  /* Appended (a struct_size that ends before it reads as -1): the GPU this
   * process drives, one process per GPU. -1: the launcher's local rank
   * (LOCAL_RANK under torchrun and strata-launch, OMPI_COMM_WORLD_LOCAL_RANK,
   * SLURM_LOCALID; 0 without a launcher); else that index, e.g. 0 when
   * CUDA_VISIBLE_DEVICES gives each process one GPU. An index past the last
   * GPU is INVALID naming both numbers; without a GPU it does not matter.
   * With a GPU the engine makes it current on the thread that creates the
   * engine and on its own threads (see strata_engine_placement). */
  int device;
  /* Appended (a struct_size that ends before it reads as 0): a group that
   * got no gradients in a step (no strata_engine_grads call for it). 0: it
   * is updated as with zero gradients (its moments decay, weight decay
   * applies), as DeepSpeed's flat optimizer does. Nonzero: it is left
   * untouched, its parameters, master and moments bitwise as they were, as
   * torch's optimizers skip a parameter whose .grad is None; each group then
   * counts its own updates, which its bias correction follows
   * (strata_engine_group_steps), and checkpoints save the counts. */
  int skip_groups_without_grads;
} strata_engine_options_t;
#define STRATA_ENGINE_OPTIONS_INIT \
  { sizeof(strata_engine_options_t), 0, 0, 1, 0, 0, -1, 0 }

/* Creates an engine from a JSON config (DeepSpeed dialect plus a "strata"
 * section). `options` may be NULL: STRATA_ENGINE_OPTIONS_INIT's values (the
 * ranks from the launcher's variables; rank 0 of 1 without a launcher; set
 * world_size 1 to run alone under one). On STRATA_OK *out owns the
 * engine; the caller frees it with strata_engine_destroy. `json` is read
 * only during the call. With a GPU, the engine's GPU (options->device, by
 * default the launcher's local rank) becomes the calling thread's current
 * CUDA device, and with strata.numa_bind "auto" on a machine of several
 * NUMA nodes every thread of the process is bound to the GPU's node
 * (strata_engine_placement says what was done).
 * Errors: INVALID (null json/out, bad options, a device or local rank past
 * the last GPU, naming both numbers), CONFIG (a bad key or value,
 * named in the message), UNSUPPORTED (a feature this build lacks), NOMEM, IO
 * (io_uring refused with strata.io_backend "io_uring", say), and with
 * several ranks COMM (the rendezvous store unreachable) or TIMEOUT.
 * Thread-safe. */
STRATA_API strata_status_t strata_engine_create(const char* json, const strata_engine_options_t* options,
                                                strata_engine_t** out);

/* Frees the engine and its memory, closes its swap files and deletes them
 * (swap is scratch: only checkpoints outlive the engine; a checkpoint that
 * links a swap file keeps its data), and writes the trace when
 * strata.trace_path is set. NULL is a no-op. The engine must not be in use
 * by another thread. In a child of fork it does nothing: the engine, its
 * swap files and its trace are the parent's. Always returns STRATA_OK. */
STRATA_API strata_status_t strata_engine_destroy(strata_engine_t* engine);

/* Registers `numel` parameters named `name` in `group` (0-based; groups must
 * have no gaps at build). `init` holds numel fp32 values, or is NULL for
 * zeros; it is copied during the call and kept (fp32, outside the budgets)
 * until build ends: a group's values up to its last tensor given `init`.
 * With several ranks every rank starts from rank 0's values, which build
 * sends to the others (only as many as rank 0 was given). A model larger
 * than RAM registers with NULL and writes its weights after build
 * (strata_engine_write_state). On STRATA_OK, *offset_out (may be
 * NULL) receives the tensor's offset, in elements, inside its group's buffer.
 * The tensor has no shape: strata-export writes it flat (1-D); see
 * strata_engine_add_param_shaped. A name is UTF-8, not empty, and used
 * once in its group, as a tensor's name or an alias (it is recorded in
 * checkpoints); a group holds at most 2^40 elements. REQUIRES: before
 * strata_engine_build. Errors: INVALID naming the tensor (those rules, 0 or
 * more than 2^40 elements), STATE. */
STRATA_API strata_status_t strata_engine_add_param(strata_engine_t* engine, int group, const char* name,
                                                   uint64_t numel, const float* init, uint64_t* offset_out);

/* The most dims strata_engine_add_param_shaped takes. */
#define STRATA_MAX_NDIM 32

/* strata_engine_add_param with a shape: `ndim` dims in `shape`, outermost
 * first (row-major, as torch and numpy lay tensors out); ndim 0 is a scalar
 * (one element; `shape` may then be NULL). The tensor has the product of the
 * dims as its numel, and `init` (NULL = zeros) holds that many fp32 values.
 * The shape is kept with the tensor and recorded in checkpoints, so that
 * strata-export writes the tensor in it (a tensor registered with
 * strata_engine_add_param is exported flat, 1-D). A checkpoint that holds
 * a shape loads only into an engine that registers that tensor with the
 * same shape or with none (INVALID names the tensor and both shapes); a
 * checkpoint without shapes loads either way. On STRATA_OK, *offset_out
 * (may be NULL) receives the tensor's offset, in elements, in its group.
 * REQUIRES: before strata_engine_build. Errors: INVALID naming the tensor
 * (NULL name or shape, ndim outside 0..STRATA_MAX_NDIM, a dim < 1, more than
 * 2^40 elements, a name as strata_engine_add_param refuses it), STATE. */
STRATA_API strata_status_t strata_engine_add_param_shaped(strata_engine_t* engine, int group,
                                                          const char* name, int ndim, const int64_t* shape,
                                                          const float* init, uint64_t* offset_out);

/* Names tensor `of`, registered in `group`, also `alias`: a weight tied
 * between two modules (a GPT's embedding and head) is one tensor with one
 * master; checkpoints record the alias and strata-export writes the values
 * under both names, so the exported file loads into a model that has both.
 * A tensor has at most 64 aliases. REQUIRES: before strata_engine_build.
 * Errors: INVALID (`of` not in the group, `alias` already a name or alias
 * there, NULL, empty or not UTF-8, a 65th alias), STATE. */
STRATA_API strata_status_t strata_engine_add_alias(strata_engine_t* engine, int group, const char* alias,
                                                   const char* of);

/* Marks `group` frozen: parameters that forward and backward read but that
 * never train (a LoRA fine-tune's base weights). A frozen group keeps its
 * parameters P alone, in the compute dtype (strata_engine_compute_dtype),
 * homed where zero_optimization.offload_param.device says, as every group's
 * P is: it has no gradient accumulator, no fp32 master and no moments in
 * any tier or staging buffer, and the budgets and build's checks count its
 * P alone. Its values are the values given to add_param in the compute
 * dtype: with bf16 (or fp16) an fp32 original is rounded to nearest even,
 * with fp32 it is kept exactly.
 *   - strata_engine_fetch and _release work on it as on any group (at
 *     stage 3 its shards are gathered).
 *   - strata_engine_grads on it is INVALID, naming it. strata_engine_step,
 *     _grad_norm, clipping, overlap_step and the GPU update leave it out:
 *     it stays bitwise unchanged, and the other groups step bitwise as if
 *     it were not there.
 *   - strata_engine_read_master gives its P widened to fp32 (exact);
 *     strata_engine_write_state(STRATA_STATE_MASTER) sets its P (rounded to
 *     the compute dtype): this is how a trainer's load_state_dict reaches
 *     it. EXP_AVG and EXP_AVG_SQ are INVALID, naming it.
 *   - Checkpoints save its P as it is (in the compute dtype) and load it
 *     into an engine that freezes the same groups; a checkpoint whose
 *     groups are frozen otherwise is INVALID naming the first that differs.
 *     strata-export writes it as it writes every tensor.
 * A group may be frozen before any of its tensors is added; freezing it
 * again does nothing. With several ranks, every rank freezes the same
 * groups (else build is INVALID naming the group).
 * REQUIRES: before strata_engine_build. Errors: INVALID (group outside
 * 0..1000000), STATE (after build; at build: a frozen group with no
 * tensors). */
STRATA_API strata_status_t strata_engine_freeze_group(strata_engine_t* engine, int group);

/* *out = 1 when strata_engine_freeze_group marked `group`, else 0. Before
 * build any group in 0..1000000 may be asked; after build, the engine's.
 * Errors: INVALID. */
STRATA_API strata_status_t strata_engine_group_frozen(strata_engine_t* engine, int group, int* out);

/* Lays the groups out, allocates every block in its home tier, reserves swap
 * space and writes the initial state. Swap files are created in the swap
 * folders (zero_optimization.offload_*.nvme_path or strata.nvme_paths),
 * which must already exist and be writable: the engine does not create
 * them (IO for a missing or unwritable folder, INVALID for a path that is
 * not a folder, naming it). A failed build leaves no swap files behind.
 * Errors: STATE (twice, or no params), CONFIG/NOMEM (a group larger than a
 * budget), NOSPACE, IO, INVALID. */
STRATA_API strata_status_t strata_engine_build(strata_engine_t* engine);

/* Streams and lifetimes (with a GPU; without one every pointer is host
 * memory, every stream argument is ignored and every call is synchronous):
 *   - fetch: the buffer's data is complete when the call returns, so work on
 *     any stream may read it at once. It stays valid while the group's
 *     fetch count is above zero.
 *   - release: records an event on `cuda_stream` and waits for it before
 *     the count goes down, so work queued on that stream that reads the
 *     buffer is done when the call returns. Reads queued on other streams
 *     are the caller's to finish first (or to order before `cuda_stream`).
 *     From the release that brings the count to zero the engine may evict
 *     the copy and hand its memory to another group at any time: a tensor
 *     that views it (an autograd saved tensor, say) must not be read after
 *     that release, but fetched again.
 *   - grads: waits for the work queued on `cuda_stream` (which must include
 *     every write of `grads`), then copies the gradients out on the engine's
 *     own stream and waits for that copy before returning. The engine keeps
 *     no reference: the caller may free or reuse `grads` when the call
 *     returns, and must keep it alive until then (the call is synchronous,
 *     so holding it across the call is enough).
 *   - eviction and the engine's own copies: only copies at count zero are
 *     evicted, after the release above waited for the caller; the engine's
 *     copies in and out run on its own streams and each is waited for
 *     before its data is used or its memory is given back.
 * The strict host arena (STRATA_STRICT_DEVICE=1, machines without a GPU)
 * checks this contract in tests: its copies lag, and released copies are
 * evicted at once and their memory filled with NaN. */

/* Brings the group's full parameters, in the compute dtype
 * (strata_engine_compute_dtype), to the device and sets *device_ptr to
 * them. Fetches are reference-counted per group: each fetch adds one, each
 * strata_engine_release takes one away, and while the count is above zero
 * the buffer stays in place (every fetch returns the same pointer). The
 * buffer is owned by the engine, read-only for the caller, and valid until
 * the release that brings the count back to zero. The data is complete
 * before the call returns, so work on `cuda_stream` (a cudaStream_t; NULL =
 * the default stream) may read it at once. Without a GPU the pointer is host
 * memory and the stream is ignored; on one rank with strata.device_budget
 * "auto" it is the parameters' home itself where that is host memory (no
 * copy), as it is with P homed on the device: there an overlapped update of
 * the group (overlap_step) rewrites it once the group's gradients of the
 * step are complete, so read it only until then. REQUIRES: after build. Errors: INVALID,
 * STATE, IO, CORRUPT, NOMEM (the device budget is full of fetched groups),
 * TIMEOUT, COMM. */
STRATA_API strata_status_t strata_engine_fetch(strata_engine_t* engine, int group, void* cuda_stream,
                                               void** device_ptr);

/* Undoes one strata_engine_fetch of the group (its count goes down by one).
 * Work already queued on `cuda_stream` that reads the buffer is waited for
 * first. Nothing is freed: at count zero the buffer stays cached and may be
 * evicted or replaced from then on. Errors: INVALID, STATE (count already
 * zero: not fetched). */
STRATA_API strata_status_t strata_engine_release(strata_engine_t* engine, int group, void* cuda_stream);

/* Adds the group's full gradients (group numel elements of `dtype`, on the
 * device; host memory without a GPU) to its fp32 accumulator; the first call
 * of a step overwrites. Work queued on `cuda_stream` that writes `grads` is
 * waited for first; `grads` stays owned by the caller and may be reused when
 * the call returns. A call that fails leaves the accumulator as it was
 * before it (a stored accumulator is replaced only once wholly written), so
 * the same call may be retried. With several ranks the gradients are
 * summed over the ranks (all-reduced, or reduce-scattered at stages 2-3);
 * with strata.grad_reduce "mean" (the default) the step then divides the sum
 * by world_size x grad_accumulation_steps, so each rank hands the gradient of
 * its own mean loss and the step sees the global batch's mean, as under torch
 * DDP; "sum" leaves the sum as it is. A frozen group (strata_engine_freeze_group)
 * takes none: INVALID naming it. Errors: INVALID, STATE, IO, NOMEM, COMM. */
STRATA_API strata_status_t strata_engine_grads(strata_engine_t* engine, int group, const void* grads,
                                               strata_dtype_t dtype, void* cuda_stream);

/* One strata_engine_grads call given in parts, e.g. one per parameter as
 * backward produces them, where the group's accumulator is host memory:
 *   - strata_engine_grads_part copies elements [first, first + count) of the
 *     group's gradient (`dtype`, host memory; caller-owned, reusable when the
 *     call returns) straight into the accumulator: no buffer of the whole
 *     group to fill first, and no second copy. Parts come in any order; a
 *     part given again exactly (a parameter backward reached twice) is added
 *     to it; one that overlaps another otherwise is INVALID.
 *   - strata_engine_grads_end completes the call: elements no part gave are
 *     zero, and from here it is one strata_engine_grads call of the
 *     assembled gradient, bitwise (the norm's sum of squares included): it
 *     counts toward grad_accumulation_steps and may start the group's
 *     overlapped update.
 * Taken for a group where strata_engine_takes_grad_parts sets *out to 1:
 *   - one rank, no GPU: the accumulator in host memory and of `dtype`
 *     (float32, or bf16 with data_types.grad_accum_dtype "bf16");
 *   - several ranks, no GPU, zero_optimization.overlap_comm on: the parts
 *     (any dtype) of the whole group's gradient (elements of group numel)
 *     are packed as they come into the reduction's buffer, and the end
 *     reduces it as strata_engine_grads would (the same sums, bitwise; a
 *     part given again is added in its dtype). One group's call in parts at
 *     a time: parts of another while one is open are INVALID naming it (hand
 *     that group whole); the open call holds a reduction buffer, and a whole
 *     strata_engine_grads meanwhile waits for the other one.
 * Otherwise, and for a group that already had gradients this step (parts
 * are a step's first gradients of a group), INVALID naming why: hand the
 * group whole. While a call in
 * parts is open, strata_engine_grads on that group, strata_engine_grad_norm,
 * strata_engine_prepare_step and strata_engine_step are INVALID naming it;
 * a call never ended leaves no gradient (a checkpoint load drops it).
 * Errors: INVALID, STATE. */
STRATA_API strata_status_t strata_engine_grads_part(strata_engine_t* engine, int group, uint64_t first,
                                                    uint64_t count, const void* grads, strata_dtype_t dtype);
/* strata_engine_grads_part, but the part is lent, not copied: the engine may
 * keep reading `grads` (its values unchanged) after the call returns, until
 * the next strata_engine_step or strata_checkpoint_load returns (whatever
 * its status), or strata_engine_destroy.
 * Keep it alive and unchanged until then. Where the step's update can read
 * the part where it is (one rank, no GPU, fp32 state_format, W, M, V in
 * host memory, and no overlapped early update of the group), it does, and no copy of it is
 * made in the middle of backward: the part's squares are taken from it, and
 * the update reads it beside W, M and V. Anything else that needs the
 * group's accumulator whole (strata_engine_grads_view, a second grads call
 * of the group in the step, a part given again, a step that returns
 * unfinished, prepare_step's early updates) copies it in first. With several
 * ranks, where the reduction is a reduce-scatter (stage 2-3) over shared
 * memory (every rank on this host) and its sums go straight into the
 * group's accumulator (float32, host memory), a float32 part is not packed:
 * the reduce-scatter reads it where it is, on the communication thread, and
 * the call in parts holds no reduction buffer. A part not lent, of another
 * dtype or given again packs the ones lent before it and is packed (as is
 * every later part of that call; a call whose first part is not lent packs
 * all of them). strata_engine_grads_lent says when the engine is done with
 * a group's lent parts (copied, or reduced), so that a caller may free
 * them before the step. Where none of that applies it is
 * strata_engine_grads_part. The results are bitwise those of
 * strata_engine_grads_part. Errors: as strata_engine_grads_part. */
STRATA_API strata_status_t strata_engine_grads_part_lend(strata_engine_t* engine, int group, uint64_t first,
                                                         uint64_t count, const void* grads, strata_dtype_t dtype);
STRATA_API strata_status_t strata_engine_grads_end(strata_engine_t* engine, int group);
/* *out = 1 while the engine may still read gradient parts lent to the group
 * in this step (strata_engine_grads_part_lend), 0 once it reads none of
 * them: they were copied (one rank: where the update cannot read them in
 * place; several: packed), or their reduction ran. From 0 on, those parts
 * are the caller's again, before the step. 1 stays until strata_engine_step
 * or strata_checkpoint_load returns where the step itself reads them (one
 * rank, the state in host memory). Errors: INVALID (a bad group), STATE
 * (not built, or unusable after an earlier error). */
STRATA_API strata_status_t strata_engine_grads_lent(strata_engine_t* engine, int group, int* out);
/* *out = 1 when the group takes gradients of `dtype` in parts, else 0; with
 * 0, strata_last_error says why not (the call itself returns OK). */
STRATA_API strata_status_t strata_engine_takes_grad_parts(strata_engine_t* engine, int group, strata_dtype_t dtype,
                                                          int* out);
/* This step's gradients of the group as accumulated, for reading (e.g. a
 * trainer's own norm of one tensor): *out points at group numel elements
 * of the accumulator's dtype (float32, or bf16 with grad_accum_dtype
 * "bf16"), host memory the caller must not write (an overlapped update may
 * be reading it). Valid until strata_engine_step, another gradient of the
 * group, or a checkpoint load. Where strata_engine_takes_grad_parts would
 * refuse for a reason other than the dtype, INVALID naming it; STATE when
 * the group has had no gradients this step. */
STRATA_API strata_status_t strata_engine_grads_view(strata_engine_t* engine, int group, const void** out);

/* Activations in the tiers: a trainer stashes a buffer during forward and
 * redeems it in backward (docs/c-guide.md, "Activations").
 *   - strata_engine_stash waits for the work queued on `cuda_stream` (which
 *     must include every write of `src`), copies `bytes` at `src` (device
 *     memory with a GPU, else host memory) into the engine and sets
 *     *handle_out. `src` may be reused when the call returns. The copy is
 *     kept in host memory (an arena of strata.activation_host_bytes, from
 *     the host budget) or written on to NVMe (strata.activation_nvme_bytes
 *     of swap, checksummed) when the arena keeps less free than
 *     strata.activation_prefetch_bytes.
 *   - strata_engine_redeem waits for the work queued on `cuda_stream` (which
 *     must include every use of `dst` so far), copies the stash back into
 *     `dst` (the same bytes; device memory with a GPU) and frees it. The
 *     data is in `dst` when the call returns: work on any stream may read
 *     it. Each redeem
 *     reads ahead, in the background, the NVMe stashes made before it (in
 *     reverse stash order, as backward redeems), up to the prefetch bytes.
 *     A stash whose checksum does not match is CORRUPT, never handed out.
 *   - strata_engine_drop_stash frees a stash unread.
 * Stashes never enter checkpoints. Errors: INVALID (null pointer, 0 bytes,
 * an unknown handle, a size that differs from the stash's), STATE (not
 * built, or no activation store: strata.activation_host_bytes is 0), NOMEM
 * (the arena and the swap are full, naming both), IO, CORRUPT. */
STRATA_API strata_status_t strata_engine_stash(strata_engine_t* engine, const void* src, uint64_t bytes,
                                               void* cuda_stream, uint64_t* handle_out);
STRATA_API strata_status_t strata_engine_redeem(strata_engine_t* engine, uint64_t handle, void* dst,
                                                uint64_t bytes, void* cuda_stream);
STRATA_API strata_status_t strata_engine_drop_stash(strata_engine_t* engine, uint64_t handle);

/* Options that may change every step. Negative = the config's value (the
 * _INIT macro sets every field so); zero is a value like any other; NaN and
 * infinities are refused (INVALID naming the option). */
typedef struct strata_step_options {
  size_t struct_size;
  double lr;
  double beta1, beta2;
  double eps;
  double weight_decay;
  /* Appended (a struct_size that ends before it reads as -1): clips the global
   * gradient norm (after strata.grad_reduce) to this, as torch's
   * clip_grad_norm_: the gradients are scaled by max/(norm + 1e-6) when that
   * is below 1. Zero: no clipping; negative: the config's gradient_clipping. */
  double max_grad_norm;
} strata_step_options_t;
#define STRATA_STEP_OPTIONS_INIT \
  { sizeof(strata_step_options_t), -1.0, -1.0, -1.0, -1.0, -1.0, -1.0 }

typedef struct strata_step_result {
  size_t struct_size;
  double grad_norm;  /* global L2 norm of the unscaled gradients, after
                        strata.grad_reduce (the mean by default): the norm
                        that gradient_clipping compares with */
  int skipped;       /* nonzero: nothing was updated (fp16 overflow, or
                        non-finite gradients with strata.nonfinite "skip") */
  double loss_scale; /* the scale for the next loss (fp16), else 1 */
} strata_step_result_t;
#define STRATA_STEP_RESULT_INIT \
  { sizeof(strata_step_result_t), 0.0, 0, 1.0 }

/* With overlap_step: announces the options of the coming step, before its
 * first strata_engine_grads (without overlap_step the call only records
 * them). When strata_engine_step then gets other options, the speculative
 * early updates are discarded and redone with step's (a warning, once; the
 * result is still exact); where the early updates were not speculative
 * (no clipping, no fp16, strata.nonfinite "apply") they are committed
 * already, and step refuses other options with INVALID. `options` may be
 * NULL (all from the config). Errors: INVALID (an option the kernels
 * refuse: nothing changes), STATE (after this step's first grads). */
STRATA_API strata_status_t strata_engine_prepare_step(strata_engine_t* engine,
                                                      const strata_step_options_t* options);

/* Runs the optimizer over every shard (norm, clipping, loss scaling, update)
 * and writes the new parameters to their home tier. `options` may be NULL
 * (all from the config); `result` may be NULL. A group that got no
 * gradients this step is updated as with zero gradients (its moments decay
 * and weight decay applies), as DeepSpeed's flat optimizer does, or, with
 * the option skip_groups_without_grads, left untouched as torch leaves a
 * parameter whose .grad is None; a frozen group
 * (strata_engine_freeze_group) is not updated at all. Non-finite
 * gradients follow strata.nonfinite (default "skip": nothing is updated and
 * result->skipped is set).
 *
 * A step that fails part-way (a disk error, a full disk, a lost peer) is
 * resumable and exact: each group's master weights and moments are either
 * wholly updated or untouched (new versions go to fresh places on disk and
 * replace the old ones together), the step count is unchanged, and the
 * gradients are kept. Calling strata_engine_step again with the same options
 * finishes only the groups not yet updated and gives bitwise the result of a
 * step that never failed; different options are refused (INVALID) and
 * change nothing. Until then grads, prepare_step, read_master, read_state,
 * write_state and checkpoint_save return STATE; fetch still works. With
 * several ranks every rank returns an error when any rank's step failed, and
 * every rank calls step again. When the step cannot be finished (its
 * gradients cannot be read back, or device memory was left half written)
 * the call returns STATE saying why, and every call but checkpoint_load
 * (which abandons the step) returns STATE until a checkpoint is loaded.
 * Write-behind (strata.write_behind, W, M, V on NVMe in units; "auto":
 * one rank): step returns once every group is updated and its W, M, V
 * writes go on in the background; anything that reads them first waits. A
 * write that fails then is reported by the next call that waits
 * (prepare_step, step, checkpoint_save, read_state, write_state, a fetch
 * that reads NVMe): the engine is broken, as above, until a checkpoint is
 * loaded. With several ranks it writes behind under "auto" only where the
 * ranks can agree on a lost write (P and G not on NVMe, or P's copies kept):
 * then every rank's next step returns STATE naming it, the communicator
 * intact, and a checkpoint_load recovers in place; under "always"
 * otherwise every rank's next step fails at once (COMM, naming it), and the
 * ranks are restarted from a checkpoint.
 * Errors: INVALID, STATE, IO, CORRUPT, NOSPACE, COMM, TIMEOUT. */
STRATA_API strata_status_t strata_engine_step(strata_engine_t* engine, const strata_step_options_t* options,
                                              strata_step_result_t* result);

/* Drops every gradient given since the last step, as torch's zero_grad
 * does: for a backward that failed part-way, or a batch to skip after its
 * gradients went in. Nothing is updated (with overlap_step, a speculative
 * early update is discarded, exactly), and the step count, the groups'
 * update counts and the loss scale stay as they were; the next step takes
 * only the gradients given after this call. Lent parts are the caller's
 * again. With several ranks it is a collective in the step's place: every
 * rank calls it where it would call strata_engine_step (a rank that calls
 * step instead fails both, COMM naming them). Errors: STATE (an early
 * update of this step is committed already: overlap_step with no clipping,
 * no fp16 and strata.nonfinite "apply"; a failed step is pending; a group
 * is fetched), INVALID (a grads call in parts is open), COMM, TIMEOUT.
 * Counted in
 * the stats as a skipped step. */
STRATA_API strata_status_t strata_engine_discard_grads(strata_engine_t* engine);

/* Sets *norm to the global L2 norm of this step's gradients so far, as
 * strata_engine_step will see it: after strata.grad_reduce, without the fp16
 * loss scale; infinite when a gradient is not finite. For a trainer that
 * logs the norm before stepping or clips with it (torch's clip_grad_norm_
 * returns it). Changes nothing. With several ranks at stages 1-3 (which
 * shard the gradients) it is a collective: every rank calls it at the same
 * point of its step; call it on every rank at stage 0 too, for one rule.
 * Errors: INVALID, STATE, COMM, TIMEOUT. */
STRATA_API strata_status_t strata_engine_grad_norm(strata_engine_t* engine, double* norm);

/* Copies the group's fp32 master weights, without padding, into `out`
 * (strata_engine_group_numel floats, caller-owned host memory); a frozen
 * group's parameters, widened from the compute dtype.
 * REQUIRES: after build. Errors: INVALID, STATE, IO, CORRUPT. */
STRATA_API strata_status_t strata_engine_read_master(strata_engine_t* engine, int group, float* out);

/* Checkpoints. Save writes this rank's master weights and moments (from
 * whatever tier they live in; a frozen group's parameters, in the compute
 * dtype), the step count, the loss scaler and the
 * caller's opaque `blob` (its data position, RNG, scheduler: `blob_bytes`
 * bytes, may be 0, at most 4 GiB: more is INVALID before anything is
 * written) to DIR/TAG, then points DIR/latest at it. DIR is
 * created if missing. An existing TAG is never overwritten: saving to it is
 * INVALID unless it already holds exactly this state (rank 0's blob
 * included) and is the newest
 * checkpoint in DIR (a save killed before it moved `latest`, repeated),
 * which then only updates DIR/latest. Files are fsynced and renamed into place:
 * a crash leaves the previous or the new checkpoint whole.
 * Load (tag NULL or "" = the newest complete checkpoint in DIR, normally
 * the one DIR/latest names) checks the manifest and every checksum
 * before changing anything: CORRUPT names the file, and the engine is as it
 * was. NOT_FOUND means nothing was saved there: DIR does not exist, holds
 * neither `latest` nor a tag folder, or the named TAG does not exist (a
 * trainer starts fresh); a checkpoint that is there but damaged is CORRUPT.
 * What the machine cannot read (DIR, `latest` or a checkpoint's file: no
 * permission, no file descriptor left, an I/O error) is IO naming why, never
 * NOT_FOUND or CORRUPT; a save that cannot read DIR fails the same way
 * (its save order would be wrong). A save that fails after its checkpoint is
 * published (the folder's fsync, `latest`) says so: it loads as the newest.
 * Its blob is copied into `blob` (capacity `*blob_bytes` in, length
 * out). When the blob does not fit, the state is still loaded and the call
 * returns INVALID with the needed length in *blob_bytes.
 * REQUIRES: after build, between steps (nothing fetched, no gradients
 * pending); a load may also follow a failed or broken step, which it
 * abandons. Errors: INVALID, STATE, IO, NOSPACE, CORRUPT, UNSUPPORTED,
 * NOT_FOUND (load). */
STRATA_API strata_status_t strata_checkpoint_save(strata_engine_t* engine, const char* dir, const char* tag,
                                                  const void* blob, uint64_t blob_bytes);
STRATA_API strata_status_t strata_checkpoint_load(strata_engine_t* engine, const char* dir, const char* tag,
                                                  void* blob, uint64_t* blob_bytes);

/* The scale to multiply the next loss (or its gradients) by: fp16's dynamic
 * loss scale, 1 without fp16. Also returned by every step. Errors: INVALID. */
STRATA_API strata_status_t strata_engine_loss_scale(strata_engine_t* engine, double* out);

/* The optimizer's state of a group, for a trainer's own state_dict:
 * strata_engine_group_numel floats, caller-owned host memory. Read gathers
 * the shards across ranks (every rank calls it). Write takes the whole
 * group's values (every rank passes the same) and, for the master weights,
 * refreshes the parameters; it works between steps. EXP_AVG_SQ exists for
 * Adam and AdamW only. A frozen group has MASTER alone (its parameters: see
 * strata_engine_freeze_group). The step count drives bias correction.
 * Memory beyond the budgets, for the call: with several ranks a read takes
 * the group's padded fp32 (4 bytes an element); with strata.state_format
 * "compact" a read or write unpacks W, M and V of this rank's shard (12
 * bytes an element of it). A write in a group stepped in units that fails
 * after some units were written breaks the engine (STATE until a load).
 * Errors: INVALID, STATE, IO, CORRUPT, COMM. */
typedef enum strata_state {
  STRATA_STATE_MASTER = 0,    /* fp32 master weights */
  STRATA_STATE_EXP_AVG = 1,   /* first moment (Lion: momentum; Adagrad: sum of squares) */
  STRATA_STATE_EXP_AVG_SQ = 2 /* second moment (Adam, AdamW) */
} strata_state_t;
STRATA_API strata_status_t strata_engine_read_state(strata_engine_t* engine, int group, strata_state_t which,
                                                    float* out);
STRATA_API strata_status_t strata_engine_write_state(strata_engine_t* engine, int group, strata_state_t which,
                                                     const float* in);
/* The optimizer updates applied so far (steps that were not skipped). Set
 * also sets every group's own count (strata_engine_group_steps), to a count
 * in 0..INT64_MAX-1 (INVALID outside). Get works at any time (0 before
 * build). Set REQUIRES: after build (STATE before it: build starts every
 * count at 0), between steps (STATE while gradients of a step are
 * pending). Errors: INVALID, STATE. */
STRATA_API strata_status_t strata_engine_get_steps(strata_engine_t* engine, int64_t* out);
STRATA_API strata_status_t strata_engine_set_steps(strata_engine_t* engine, int64_t steps);
/* The updates applied to `group`, which its bias correction counts from:
 * strata_engine_get_steps' count, unless the engine was created with
 * skip_groups_without_grads, where a group counts only the steps in which
 * it got gradients (torch's per-parameter state["step"]); 0 for a frozen
 * group. Set works between steps, with skip_groups_without_grads only (else
 * INVALID: every group follows strata_engine_set_steps), not on a frozen
 * group (INVALID). REQUIRES: after build. Errors: INVALID, STATE. */
STRATA_API strata_status_t strata_engine_group_steps(strata_engine_t* engine, int group, int64_t* out);
STRATA_API strata_status_t strata_engine_set_group_steps(strata_engine_t* engine, int group, int64_t steps);

/* The engine's resolved config as JSON (every key, defaults filled in, in
 * DeepSpeed's spelling; budgets as given, bytes or "auto"), NUL-terminated,
 * into `out` of *size bytes. *size is set to the bytes needed (with the
 * NUL); with `out` NULL only that is done. Errors: INVALID (a buffer too small: nothing
 * written, *size says what is needed). */
STRATA_API strata_status_t strata_engine_config(strata_engine_t* engine, char* out, size_t* size);

/* Shape queries. REQUIRES for group_numel: after build. Errors: INVALID. */
STRATA_API strata_status_t strata_engine_num_groups(strata_engine_t* engine, int* out);
STRATA_API strata_status_t strata_engine_group_numel(strata_engine_t* engine, int group, uint64_t* out);
STRATA_API strata_status_t strata_engine_compute_dtype(strata_engine_t* engine, strata_dtype_t* out);
/* *out = 1 when fetched buffers and gradients are CUDA device memory, 0 when
 * they are host memory (no GPU, or force_no_gpu). Errors: INVALID. */
STRATA_API strata_status_t strata_engine_device_is_gpu(strata_engine_t* engine, int* out);

/* Where this process landed, decided at strata_engine_create, as one line
 * for a log: "rank 1/4: GPU 1 (NVIDIA H200, NUMA node 0); cores 0-15 bound to
 * node 0; pinned memory on node 0", or "rank 0/1: no GPU (force_no_gpu):
 * device tier is a host arena; no NUMA binding (no GPU); host memory on node
 * 0". The GPU is the options' device (by default the launcher's local rank);
 * with strata.numa_bind "auto" (docs/config.md) the process's threads and
 * pinned memory are bound to the GPU's NUMA node, and when they are not the
 * line says why. NUL-terminated, into `out` of *size bytes; *size is set to
 * the bytes needed (with the NUL); with `out` NULL only that is done.
 * strata_stats_t.gpu_device and .numa_node hold the same as numbers.
 * Errors: INVALID (NULL size; a buffer too small: nothing written, *size
 * says what is needed). */
STRATA_API strata_status_t strata_engine_placement(strata_engine_t* engine, char* out, size_t* size);

typedef struct strata_tier_stats {
  uint64_t budget, used, peak; /* bytes */
} strata_tier_stats_t;

typedef struct strata_stats {
  size_t struct_size;
  strata_tier_stats_t device, host, nvme;
  /* Bytes moved between tiers, cumulative. */
  uint64_t nvme_to_host, host_to_nvme, host_to_device, device_to_host;
  uint64_t fetches, prefetch_hits, fetch_stalls;
  double fetch_stall_s;
  /* Busy seconds of each resource in the last step, and its wall time. */
  double disk_busy_s, copy_busy_s, cpu_optimizer_s, step_wall_s;
  double overlap_efficiency; /* largest busy time / wall time, last step */
  uint64_t steps, skipped_steps;
  /* Appended (a shorter struct_size leaves them out). The device tier keeps
   * freed blocks for reuse: bytes cached (counted in device.used), device
   * allocations made (cudaMalloc) so far, and allocations the cache served. */
  uint64_t device_cached, device_raw_allocs, device_pool_hits;
  /* Appended. Where the process landed (strata_engine_placement says it in
   * words): the GPU it drives, -1 without one; the NUMA node its CPUs are
   * bound to, -1 when they are not. */
  int gpu_device, numa_node;
  /* Appended. overlap_step: steps whose early updates were speculative
   * (held until the gradients' norm was known), and of those the ones
   * committed, replayed (clipping applied, or step got other options than
   * prepare_step: redone after backward) and discarded (the step was
   * skipped: an fp16 overflow, strata.nonfinite); groups updated before the
   * end of backward, cumulative; and the last step's exposed time, from the
   * return of its last strata_engine_grads to the return of
   * strata_engine_step (0 when it had none). */
  uint64_t speculated_steps, committed_steps, replayed_steps, discarded_steps, early_updates;
  double exposed_step_s;
  /* Appended. overlap_step: steps whose early updates would have been
   * speculative and that did not speculate (strata.speculation "auto"
   * expected the step to clip or skip, or "never"): they updated after
   * backward, at no extra cost. */
  uint64_t unspeculated_steps;
  /* Appended. Stashed activations (strata_engine_stash), cumulative: bytes
   * stashed into host memory (every stash is, at first) and, of those, sent
   * on to NVMe; stashes redeemed; redeems of
   * NVMe stashes that found them read ahead (hits) or waited (stalls, and
   * the seconds waited); bytes stashed and not yet redeemed or dropped. */
  uint64_t act_host_bytes, act_nvme_bytes, act_redeemed, act_prefetch_hits, act_stalls;
  double act_stall_s;
  uint64_t act_live_bytes;
  /* Appended. Stage 3 with several ranks: all-gathers of a group's
   * parameters for its fetches, cumulative. Once per group in a step's
   * forward; again in backward unless every rank's device budget holds
   * every group gathered at once (then backward finds forward's copies). */
  uint64_t p_gathers;
  /* Appended. W, M, V on NVMe: bytes a step that updated after backward
   * (no overlap_step speculation) read during backward, into the step's
   * free staging (at strata_engine_prepare_step), and then used,
   * cumulative. */
  uint64_t step_read_ahead_bytes;
  /* Appended. Steps that returned before their W, M, V writes to NVMe were
   * done (strata.write_behind: they land before the next call that needs
   * them), cumulative. A step that left them to finish and then waited for
   * them before it returned (several ranks, P on NVMe, a copy of P that
   * did not take the step's new P) is not counted; its wait is in
   * behind_wait_s. */
  uint64_t write_behind_steps;
  /* Appended. Several ranks: the collectives of the gradients' reduction
   * (each group's, every step) and the gathers of P (stage 3: for a fetch,
   * in it or ahead of it; stages 1-2: after the update, and where P is
   * recomputed from W: write_state of the master weights, a checkpoint
   * load), cumulative, on whichever thread ran them (the communication
   * thread with zero_optimization.overlap_comm). Not counted: the build's
   * broadcasts, read_state's gathers, the step's agreements. Their wall
   * seconds; the CPU seconds of that thread within them (the rest of
   * comm_s waited for the other ranks, or for a backend's own threads:
   * Gloo over TCP moves the bytes on its own, the shared memory of ranks
   * on one host on this thread; with NCCL it includes the copy of the sums
   * to host memory); the bytes this rank put into reductions (fp32 as
   * packed: each group padded to the ranks' shards, to one shard at stage
   * 0); and the bytes of P it gathered (each gather's whole group). 0 at
   * one rank. */
  double comm_s, comm_cpu_s;
  uint64_t reduced_bytes, gathered_bytes;
  /* Appended. strata.write_behind: seconds during which the engine waited
   * for the writes a step left behind (prepare_step, step, a fetch or read
   * of NVMe-homed state on any of its threads, checkpoints, state access;
   * threads waiting at once count once), cumulative: 0 where every write
   * landed before anything needed it. */
  double behind_wait_s;
  /* Appended. Of reduced_bytes, those reduce-scattered from gradient parts
   * lent (strata_engine_grads_part_lend) where they lay, without packing
   * them first (several ranks on one host, stage 2-3). */
  uint64_t lent_reduced_bytes;
  /* Appended. Threads the CPU kernels (the optimizer's update, casts, norms)
   * run on in this process: its CPUs (the affinity mask), at most its
   * cgroup's CPU limit, each rounded up to a share where several processes
   * of the job run on the same CPUs (ranks on one host; ranks that are
   * threads of one process count once). strata_engine_placement says it in
   * words. */
  int cpu_kernel_threads;
} strata_stats_t;
#define STRATA_STATS_INIT                                                                                  \
  {                                                                                                        \
    sizeof(strata_stats_t), {0, 0, 0}, {0, 0, 0}, {0, 0, 0}, 0, 0, 0, 0, 0, 0, 0, 0.0, 0.0, 0.0, 0.0, 0.0, \
        0.0, 0, 0, 0, 0, 0, -1, -1, 0, 0, 0, 0, 0, 0.0, 0, 0, 0, 0, 0, 0, 0.0, 0, 0, 0, 0, 0.0, 0.0, 0, 0,    \
        0.0, 0, 0                                                                                          \
  }

/* Fills the fields of *stats that stats->struct_size covers. Errors: INVALID. */
STRATA_API strata_status_t strata_engine_stats(strata_engine_t* engine, strata_stats_t* stats);

/* ---- Trace -------------------------------------------------------------- */

/* With "strata": {"trace_path": PATH} in the config, the engine records a
 * Chrome trace (JSON; Perfetto and chrome://tracing open it), pid = rank:
 * its disk and copy I/O, the CPU optimizer's updates ("update"; with
 * overlap_step "update (speculative)", then the step's "commit" or
 * "discard"), and on the "caller"
 * track its calls: "fetch" (args.group), "stall" inside a fetch that waited
 * for its data, "grads" (per call, args.group) and "step". The trainer adds
 * its own spans ("forward", "backward", ...) with the calls below, on a
 * track per thread that begins them (a thread that has ended may pass its
 * id, and so its track, to a later thread). The file is written at
 * strata_engine_destroy and whenever strata_engine_write_trace is called;
 * times are microseconds since the engine was created.
 *
 * Unlike the rest of the API, these three calls are thread-safe: any thread
 * may call them at any time, also while another thread drives the engine,
 * and they work on a broken engine (but not after strata_engine_destroy).
 * Without a trace path, spans are checked as below but not recorded. */

/* Opens a span named `name` (UTF-8, 1 to 256 bytes, copied) that starts now
 * and sets *token_out to its token (never 0), for strata_engine_span_end.
 * Errors: INVALID (NULL engine, name or token_out; a bad name; 100000
 * spans already open). */
STRATA_API strata_status_t strata_engine_span_begin(strata_engine_t* engine, const char* name,
                                                    uint64_t* token_out);

/* Closes the span of `token`: it ends now. Any thread may end it; it lies on
 * the track of the thread that began it. Spans begun on one thread nest:
 * only the innermost open span of that thread may end.
 * Errors: INVALID (a token that is not open: never begun or already ended;
 * a span that is not the innermost open one of its thread, named in the
 * message). A refused call changes nothing. */
STRATA_API strata_status_t strata_engine_span_end(strata_engine_t* engine, uint64_t token);

/* Writes the trace file now, with every span recorded so far; spans still
 * open are written as ending now, with args.unfinished. The file is
 * replaced whole (written to PATH.tmp, then renamed): it is valid JSON
 * after each write. Errors: INVALID (NULL engine), CONFIG (no
 * strata.trace_path in the config), IO (naming the file). */
STRATA_API strata_status_t strata_engine_write_trace(strata_engine_t* engine);

/* ---- The optimizer alone ------------------------------------------------ */

typedef enum strata_adam_mode {
  STRATA_ADAM_MODE_ADAMW = 0, /* decoupled weight decay (torch.optim.AdamW) */
  STRATA_ADAM_MODE_ADAM = 1   /* L2 penalty in the gradient (torch.optim.Adam) */
} strata_adam_mode_t;

typedef struct strata_adam_options {
  size_t struct_size;
  double lr, beta1, beta2, eps, weight_decay;
  int64_t step; /* 1-based number of this update (bias correction) */
  strata_adam_mode_t mode;
  double grad_scale;               /* multiplies the gradient first: clip / loss_scale */
  strata_dtype_t grad_dtype;       /* element type of grad */
  strata_dtype_t param_copy_dtype; /* element type of param_copy: BF16 or F16 */
} strata_adam_options_t;
#define STRATA_ADAM_OPTIONS_INIT                                                                \
  {                                                                                             \
    sizeof(strata_adam_options_t), 1e-3, 0.9, 0.999, 1e-8, 0.0, 1, STRATA_ADAM_MODE_ADAMW, 1.0, \
        STRATA_DTYPE_F32, STRATA_DTYPE_BF16                                                     \
  }

/* One Adam/AdamW step over n elements of caller-owned host arrays, in place,
 * on the fastest SIMD path of this CPU, in parallel:
 *   param, exp_avg, exp_avg_sq: n floats each (read and written)
 *   grad: n elements of options->grad_dtype (read)
 *   param_copy: NULL, or n elements of options->param_copy_dtype that receive
 *     the updated param rounded to nearest even.
 * REQUIRES: the arrays do not overlap. Thread-safe for disjoint arrays.
 * Errors: INVALID (null array with n > 0, bad options). */
STRATA_API strata_status_t strata_adam_step(const strata_adam_options_t* options, size_t n, float* param,
                                            float* exp_avg, float* exp_avg_sq, const void* grad,
                                            void* param_copy);

/* ---- Ranks: data-parallel trainers ------------------------------------- */
/* (This block: strata-train on many ranks, #14. Keep additions elsewhere.) */

/* The rank and world size that the launcher's variables say: torchrun's
 * RANK and WORLD_SIZE (strata-launch sets them too), else OpenMPI's
 * OMPI_COMM_WORLD_RANK and OMPI_COMM_WORLD_SIZE, else Slurm's SLURM_PROCID
 * and SLURM_NTASKS; none of them means rank 0 of 1. Put them in
 * strata_engine_options_t: an engine created with world_size 1 runs alone
 * even under a launcher, so every rank would train the same copy.
 * Errors: INVALID (NULL out pointers; a partial or inconsistent set of
 * variables, named in the message). Thread-safe. */
STRATA_API strata_status_t strata_rank_from_env(int* rank_out, int* world_size_out);

/* This engine's rank and world size (from its options and the launcher's
 * variables). Errors: INVALID. */
STRATA_API strata_status_t strata_engine_rank(strata_engine_t* engine, int* rank_out, int* world_size_out);

/* values[0..n) := their sums over the engine's ranks, in fp64, added in
 * rank order so that every rank gets the same bits: a data-parallel
 * trainer's figures (its loss, averaged by dividing by the world size).
 * Every rank calls it with the same n, in the same order relative to the
 * engine's other collectives (fetch at stage 3, grads, step, read_state);
 * ranks that disagree fail with COMM naming both sides. One rank, or n 0:
 * values are unchanged. `values` stays owned by the caller.
 * REQUIRES: no gradients pending (before a step's first strata_engine_grads,
 * or after its strata_engine_step). Errors: INVALID (NULL values with
 * n > 0), STATE, COMM, TIMEOUT. */
STRATA_API strata_status_t strata_engine_sum_over_ranks(strata_engine_t* engine, double* values, size_t n);

/* ---- End of the ranks block --------------------------------------------- */

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* STRATA_STRATA_H_ */
