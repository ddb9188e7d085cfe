// FloatPieces (float_pieces.h).
#include "io/net/float_pieces.h"

#include <algorithm>
#include <cstring>

namespace strata::net {

std::vector<FloatPieces::Piece>::const_iterator FloatPieces::FirstEndingAfter(uint64_t at) const {
  return std::upper_bound(pieces_.begin(), pieces_.end(), at,
                          [](uint64_t a, const Piece& p) { return a < p.first + p.count; });
}

bool FloatPieces::Add(uint64_t first, uint64_t count, const float* data) {
  if (count == 0) return true;
  // The first piece ending after `first`: those before end at or before it.
  const auto next = FirstEndingAfter(first);
  if (next != pieces_.end() && next->first < first + count) return false;
  pieces_.insert(next, Piece{first, count, data});
  return true;
}

const float* FloatPieces::Find(uint64_t at, uint64_t count) const {
  auto p = FirstEndingAfter(at);
  if (p == pieces_.end() || p->first > at || p->first + p->count < at + count) return nullptr;
  return p->data + (at - p->first);
}

void FloatPieces::Read(uint64_t at, uint64_t count, float* dst) const {
  const uint64_t end = at + count;
  for (auto p = FirstEndingAfter(at); at < end; ++p) {
    const uint64_t from = p == pieces_.end() ? end : std::min(end, std::max(at, p->first));
    if (from > at) std::memset(dst, 0, (from - at) * sizeof(float));  // no piece holds [at, from)
    dst += from - at;
    at = from;
    if (at == end) break;
    const uint64_t to = std::min(end, p->first + p->count);
    std::memcpy(dst, p->data + (at - p->first), (to - at) * sizeof(float));
    dst += to - at;
    at = to;
  }
}

}  // namespace strata::net
