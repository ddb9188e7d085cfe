// Encoding and decoding of the store's frames (see store_wire.h).
#include "io/net/store_wire.h"

namespace strata::net::wire {
namespace {

class Writer {
 public:
  Writer() { out_.resize(4); }  // room for the length
  void U8(uint8_t v) { out_.push_back(v); }
  void U32(uint32_t v) {
    for (int i = 0; i < 4; ++i) out_.push_back(static_cast<uint8_t>(v >> (8 * i)));
  }
  void U64(uint64_t v) {
    for (int i = 0; i < 8; ++i) out_.push_back(static_cast<uint8_t>(v >> (8 * i)));
  }
  void Blob(const void* p, size_t n) {
    U32(static_cast<uint32_t>(n));
    auto* b = static_cast<const uint8_t*>(p);
    out_.insert(out_.end(), b, b + n);
  }
  std::vector<uint8_t> Finish() {
    uint32_t n = static_cast<uint32_t>(out_.size() - 4);
    for (int i = 0; i < 4; ++i) out_[i] = static_cast<uint8_t>(n >> (8 * i));
    return std::move(out_);
  }

 private:
  std::vector<uint8_t> out_;
};

class Reader {
 public:
  explicit Reader(const std::vector<uint8_t>& b) : b_(b) {}
  bool U8(uint8_t* v) { return Take(1) && (*v = b_[pos_ - 1], true); }
  bool U32(uint32_t* v) {
    if (!Take(4)) return false;
    *v = DecodeLength(&b_[pos_ - 4]);
    return true;
  }
  bool U64(uint64_t* v) {
    if (!Take(8)) return false;
    *v = 0;
    for (int i = 0; i < 8; ++i) *v |= uint64_t{b_[pos_ - 8 + i]} << (8 * i);
    return true;
  }
  template <typename C>
  bool Blob(C* out) {
    uint32_t n = 0;
    if (!U32(&n) || !Take(n)) return false;
    out->assign(b_.begin() + (pos_ - n), b_.begin() + pos_);
    return true;
  }
  bool AtEnd() const { return pos_ == b_.size(); }

 private:
  bool Take(size_t n) {
    if (b_.size() - pos_ < n) return false;
    pos_ += n;
    return true;
  }
  const std::vector<uint8_t>& b_;
  size_t pos_ = 0;
};

}  // namespace

uint32_t DecodeLength(const uint8_t* p) {
  return uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16 | uint32_t{p[3]} << 24;
}

std::vector<uint8_t> EncodeRequest(const Request& r) {
  Writer w;
  w.U8(static_cast<uint8_t>(r.op));
  w.U64(r.wait_ms);
  w.U32(static_cast<uint32_t>(r.keys.size()));
  for (const auto& k : r.keys) w.Blob(k.data(), k.size());
  w.Blob(r.value.data(), r.value.size());
  return w.Finish();
}

std::vector<uint8_t> EncodeResponse(const Response& r) {
  Writer w;
  w.U8(static_cast<uint8_t>(r.status));
  w.Blob(r.payload.data(), r.payload.size());
  return w.Finish();
}

std::optional<Request> DecodeRequest(const std::vector<uint8_t>& body) {
  Reader rd(body);
  Request r;
  uint8_t op = 0;
  uint32_t nkeys = 0;
  if (!rd.U8(&op) || op < 1 || op > 4 || !rd.U64(&r.wait_ms) || !rd.U32(&nkeys)) return std::nullopt;
  r.op = static_cast<Op>(op);
  for (uint32_t i = 0; i < nkeys; ++i) {
    std::string k;
    if (!rd.Blob(&k)) return std::nullopt;
    r.keys.push_back(std::move(k));
  }
  if (!rd.Blob(&r.value) || !rd.AtEnd() || r.keys.empty()) return std::nullopt;
  return r;
}

std::optional<Response> DecodeResponse(const std::vector<uint8_t>& body) {
  Reader rd(body);
  Response r;
  uint8_t st = 0;
  if (!rd.U8(&st) || st > 2 || !rd.Blob(&r.payload) || !rd.AtEnd()) return std::nullopt;
  r.status = static_cast<Reply>(st);
  return r;
}

}  // namespace strata::net::wire
