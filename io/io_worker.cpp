// SettleChunk: how every worker decides a completion.
#include "io/io_worker.h"

#include <cerrno>
#include <string>

#include "base/align.h"

namespace strata {

void FinishChunk(IoChunk* c, Status st) {
  if (!st.ok()) c->batch->Fail(std::move(st));
  c->batch->PartDone();  // may free the batch and `c` with it
}

ChunkNext SettleChunk(IoChunk* c, int res, FaultPlan* faults, const Storage& storage, Status* st) {
  IoOp& op = c->op;
  if (faults) res = faults->Apply(c->seq, op.kind == IoOp::kWrite, res, op.len, c->align);
  const char* verb = op.kind == IoOp::kRead ? "read" : "write";
  if (res == -EINTR || res == -EAGAIN) {
    if (++c->retries <= kMaxChunkRetries) return ChunkNext::kAgain;
    *st = PosixError(verb, storage.Info(op.file).path, op.offset, op.len, -res);
    return ChunkNext::kDone;
  }
  if (res < 0) {
    *st = PosixError(verb, storage.Info(op.file).path, op.offset, op.len, -res);
    return ChunkNext::kDone;
  }
  const auto done = static_cast<uint64_t>(res);
  if (done >= op.len) {
    *st = Status::Ok();
    return ChunkNext::kDone;
  }
  // Short: continue from the aligned offset at or below what was done. One
  // shorter than the alignment (a direct read at a file's end off the
  // alignment: the same few bytes each time) advances nothing: as 0 bytes.
  const uint64_t advance = AlignDown(done, c->align);
  if (advance == 0) {
    const std::string where = storage.Info(op.file).path + " offset " + std::to_string(op.offset) + " length " +
                              std::to_string(op.len);
    if (op.kind == IoOp::kRead)
      *st = CorruptError("read " + where + ": unexpected end of file after " + std::to_string(done) +
                         " bytes (truncated?)");
    else
      *st = IoError("write " + where + ": the kernel wrote " + std::to_string(done) + " bytes, under the " +
                    std::to_string(c->align) + "-byte alignment");
    return ChunkNext::kDone;
  }
  c->retries = 0;
  op.offset += advance;
  op.buf = static_cast<char*>(op.buf) + advance;
  op.len -= advance;
  return ChunkNext::kAgain;
}

}  // namespace strata
