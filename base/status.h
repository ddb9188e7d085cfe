// Status and Result<T>: the error currency of Strata's internals.
// OK costs one null pointer; an error carries a code and a message that names
// the operation, the file or device, the offset and errno (leveldb style).
#pragma once

#include <cerrno>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <utility>

namespace strata {

// Codes mirror strata_status_t in include/strata/strata.h (same order).
enum class Code : int {
  kOk = 0,
  kInvalid,      // bad argument
  kConfig,       // bad configuration key or value
  kNoMem,        // a budget or the OS refused memory
  kIo,           // an I/O call failed
  kNoSpace,      // disk full or file too large
  kCorrupt,      // checksum mismatch, truncated file
  kComm,         // a collective or the store failed
  kTimeout,      // a wait ran past its limit
  kUnsupported,  // not available on this build or machine
  kState,        // call out of order
  kInternal,     // a bug
  kNotFound,     // nothing there: no checkpoint saved yet, no such tag
};

const char* CodeName(Code c);

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(Code code, std::string msg);
  Status(const Status& o);
  Status& operator=(const Status& o);
  Status(Status&&) noexcept = default;
  Status& operator=(Status&&) noexcept = default;

  static Status Ok() { return Status(); }
  bool ok() const { return rep_ == nullptr; }
  Code code() const { return rep_ ? rep_->code : Code::kOk; }
  const std::string& message() const;
  std::string ToString() const;  // "IO: pread /x offset 4096 ...: Input/output error"
  // Returns a copy whose message is prefixed by `context + ": "`.
  Status WithContext(const std::string& context) const;
  void IgnoreError() const {}

 private:
  struct Rep {
    Code code;
    std::string msg;
  };
  std::unique_ptr<Rep> rep_;
};

// Error constructors, one per code.
inline Status InvalidError(std::string m) { return {Code::kInvalid, std::move(m)}; }
inline Status ConfigError(std::string m) { return {Code::kConfig, std::move(m)}; }
inline Status NoMemError(std::string m) { return {Code::kNoMem, std::move(m)}; }
inline Status IoError(std::string m) { return {Code::kIo, std::move(m)}; }
inline Status NoSpaceError(std::string m) { return {Code::kNoSpace, std::move(m)}; }
inline Status CorruptError(std::string m) { return {Code::kCorrupt, std::move(m)}; }
inline Status CommError(std::string m) { return {Code::kComm, std::move(m)}; }
inline Status TimeoutError(std::string m) { return {Code::kTimeout, std::move(m)}; }
inline Status UnsupportedError(std::string m) { return {Code::kUnsupported, std::move(m)}; }
inline Status StateError(std::string m) { return {Code::kState, std::move(m)}; }
inline Status InternalError(std::string m) { return {Code::kInternal, std::move(m)}; }
inline Status NotFoundError(std::string m) { return {Code::kNotFound, std::move(m)}; }

// Turns an errno into a Status naming the operation and what it touched.
// ENOSPC, EFBIG and EDQUOT map to kNoSpace, ENOMEM to kNoMem, the rest to kIo.
// Example: PosixError("pwrite", "/nvme/strata.0.swap", 4096, 1 << 20, EIO).
Status PosixError(const std::string& op, const std::string& path, int err);
Status PosixError(const std::string& op, const std::string& path, uint64_t offset,
                  uint64_t length, int err);

// An exception caught at a boundary (the C API's guard, build's undo):
// NOMEM for std::bad_alloc; INTERNAL otherwise, naming the process's thread
// limit where std::thread could not start one (EAGAIN). `where` prefixes it.
Status StatusOfException(const std::exception& e, const std::string& where);

// Result<T>: a value or an error Status.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}  // NOLINT: implicit on purpose
  Result(Status status) : status_(std::move(status)) {}  // NOLINT
  bool ok() const { return status_.ok(); }
  const Status& status() const { return status_; }
  T& value() & { return *value_; }
  const T& value() const& { return *value_; }
  T&& value() && { return std::move(*value_); }
  T* operator->() { return &*value_; }
  const T* operator->() const { return &*value_; }
  T& operator*() { return *value_; }

 private:
  Status status_;
  std::optional<T> value_;
};

}  // namespace strata

#define STRATA_CONCAT_INNER(a, b) a##b
#define STRATA_CONCAT(a, b) STRATA_CONCAT_INNER(a, b)

// Returns from the enclosing function if `expr` yields a non-OK Status.
#define STRATA_RETURN_IF_ERROR(expr)                   \
  do {                                                 \
    ::strata::Status strata_status_ = (expr);          \
    if (!strata_status_.ok()) return strata_status_;   \
  } while (0)

// `lhs = value of expr` or return its error. lhs may be a declaration.
#define STRATA_ASSIGN_OR_RETURN(lhs, expr)                                    \
  auto STRATA_CONCAT(strata_result_, __LINE__) = (expr);                      \
  if (!STRATA_CONCAT(strata_result_, __LINE__).ok())                          \
    return STRATA_CONCAT(strata_result_, __LINE__).status();                  \
  lhs = std::move(STRATA_CONCAT(strata_result_, __LINE__)).value()
