// Status: codes, names and the errno helper.
#include "base/status.h"

#include <cstring>
#include <new>
#include <system_error>

namespace strata {

const char* CodeName(Code c) {
  switch (c) {
    case Code::kOk: return "OK";
    case Code::kInvalid: return "INVALID";
    case Code::kConfig: return "CONFIG";
    case Code::kNoMem: return "NOMEM";
    case Code::kIo: return "IO";
    case Code::kNoSpace: return "NOSPACE";
    case Code::kCorrupt: return "CORRUPT";
    case Code::kComm: return "COMM";
    case Code::kTimeout: return "TIMEOUT";
    case Code::kUnsupported: return "UNSUPPORTED";
    case Code::kState: return "STATE";
    case Code::kInternal: return "INTERNAL";
    case Code::kNotFound: return "NOT_FOUND";
  }
  return "UNKNOWN";
}

Status::Status(Code code, std::string msg) {
  if (code != Code::kOk) rep_ = std::make_unique<Rep>(Rep{code, std::move(msg)});
}

Status::Status(const Status& o) : rep_(o.rep_ ? std::make_unique<Rep>(*o.rep_) : nullptr) {}

Status& Status::operator=(const Status& o) {
  if (this != &o) rep_ = o.rep_ ? std::make_unique<Rep>(*o.rep_) : nullptr;
  return *this;
}

const std::string& Status::message() const {
  static const std::string kEmpty;
  return rep_ ? rep_->msg : kEmpty;
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  return std::string(CodeName(rep_->code)) + ": " + rep_->msg;
}

Status Status::WithContext(const std::string& context) const {
  if (ok()) return Status();
  return Status(rep_->code, context + ": " + rep_->msg);
}

static Code CodeForErrno(int err) {
  switch (err) {
    case ENOSPC: case EFBIG: case EDQUOT: return Code::kNoSpace;
    case ENOMEM: return Code::kNoMem;
    case ETIMEDOUT: return Code::kTimeout;
    case EINVAL: return Code::kInvalid;
    default: return Code::kIo;
  }
}

Status PosixError(const std::string& op, const std::string& path, int err) {
  return Status(CodeForErrno(err),
                op + " " + path + ": " + std::strerror(err) + " (errno " + std::to_string(err) + ")");
}

Status PosixError(const std::string& op, const std::string& path, uint64_t offset,
                  uint64_t length, int err) {
  return Status(CodeForErrno(err), op + " " + path + " offset " + std::to_string(offset) +
                                       " length " + std::to_string(length) + ": " +
                                       std::strerror(err) + " (errno " + std::to_string(err) + ")");
}

Status StatusOfException(const std::exception& e, const std::string& where) {
  if (dynamic_cast<const std::bad_alloc*>(&e) != nullptr) return NoMemError(where + "out of memory (std::bad_alloc)");
  const auto* se = dynamic_cast<const std::system_error*>(&e);
  const bool thread_limit = se != nullptr && se->code() == std::errc::resource_unavailable_try_again;
  return InternalError(where + "uncaught exception: " + e.what() +
                       (thread_limit ? " (a thread could not start: the process is at its thread limit, the "
                                       "cgroup's pids.max or RLIMIT_NPROC (ulimit -u); raise it)"
                                     : ""));
}

}  // namespace strata
