// Checkpoint folders on disk: small durable files (write, fsync, rename,
// fsync the folder), tag names, the complete checkpoints of a folder, and
// the leftovers of killed saves. Shared by the save (checkpoint.cpp) and the
// load (checkpoint_load.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"
#include "engine/format/manifest.h"

namespace strata::ckpt {

// STRATA_CHECKPOINT_KILL_AT=NAME: the process exits (86) at that point.
void KillPoint(const char* name);
// STRATA_CHECKPOINT_FAIL_AT=NAME: an IO error at that point (tests).
Status FaultPoint(const char* name);

Status FsyncPath(const std::string& path);
// Creates `dir` and its missing parents, each new entry made durable (its
// parent fsynced): a first save's folder must survive a power loss as its
// checkpoint does, or the load finds nothing there and a trainer starts over.
Status CreateDirsDurably(const std::string& dir);
// Reads exactly `bytes` at `off` of `fd` (the file `path`); a short file is CORRUPT.
Status PreadFull(int fd, void* buf, uint64_t bytes, uint64_t off, const std::string& path);
// Writes `path` anew: a file at the name is removed first, and the new one
// is created O_EXCL|O_NOFOLLOW (never written through a name put there).
Status WriteSmallFile(const std::string& path, const void* data, uint64_t bytes);
// Writes `text` to folder/name.tmp, fsyncs, renames to folder/name, fsyncs the folder.
Status ReplaceFile(const std::string& folder, const std::string& name, const std::string& text);
// NOT_FOUND when absent; CORRUPT when not a regular file, too large, short
// or changing; an error of the machine's (EACCES, EMFILE, EIO...) is IO (or
// NOSPACE, NOMEM...) naming it: "there but damaged" would have a trainer
// throw a good checkpoint away.
Result<std::string> ReadSmallFile(const std::string& path, uint64_t limit);

bool ValidTag(const std::string& t);
std::string RankFile(int rank);  // rank00007.bin
// Whether `path` exists (lstat) / is a folder (stat). Absent (ENOENT,
// ENOTDIR) is false; any other error is IO naming it: a folder that cannot
// be looked at is not one without checkpoints (a load would start afresh).
Result<bool> Exists(const std::string& path);
Result<bool> IsDir(const std::string& path);

// The checkpoints in `dir`: folders with a valid tag name that hold a
// manifest.json (a save in progress is a hidden .TAG.partial; a folder
// without a manifest is not a checkpoint), each with its parsed manifest
// or the error parsing it. Sorted by tag. None when `dir` does not exist;
// IO when it, or an entry in it, cannot be read.
struct Found {
  std::string tag;
  Result<manifest::Manifest> manifest;
};
Result<std::vector<Found>> ScanCheckpoints(const std::string& dir);
Result<manifest::Manifest> ReadManifestAt(const std::string& folder);
// The tag DIR/latest names ("" when there is no such file or it is damaged;
// IO when it cannot be read).
Result<std::string> LatestTag(const std::string& dir);
// True when a (save_seq, step) is older than b: the order of "newest".
bool Older(const manifest::Manifest& a, const manifest::Manifest& b);
// The newest complete checkpoint in the folder `dir`: by save order
// (save_seq, which every save numbers one past the checkpoints already
// there), then step (checkpoints of older Strata have no save_seq), then the
// one `latest` names. `latest` alone would be one behind after a save killed
// between its rename and the update of latest (warned when it is). NOT_FOUND
// when `dir` holds none; CORRUPT when latest names a folder without a
// manifest or names nothing there, or when any checkpoint's manifest is
// damaged (it might be the newest); IO when the folder, latest or an
// entry cannot be read. Errors begin with `who`.
Status FindNewest(const std::string& dir, const std::string& who, std::string* tag, manifest::Manifest* m);

// A save's .TAG.partial folder, flock'ed while the save runs so that a
// cleanup never removes the folder of a live save.
class PartialLock {
 public:
  PartialLock() = default;
  ~PartialLock();
  PartialLock(const PartialLock&) = delete;
  PartialLock& operator=(const PartialLock&) = delete;
  Status Lock(const std::string& folder);

 private:
  int fd_ = -1;
};
// Removes every .*.partial folder in `dir` that no live save holds (a killed
// save's). Returns how many; logs what it could not remove.
int RemoveAbandonedPartials(const std::string& dir);

}  // namespace strata::ckpt
