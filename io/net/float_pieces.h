// FloatPieces: an array of floats that lies in pieces where its owner has
// them (a gradient handed a parameter at a time), read there instead of
// being packed into one buffer first. Each piece is `count` elements from
// element `first`, at `data`; elements that no piece holds read as zero.
// The pieces are borrowed: whoever Adds one keeps it alive and unchanged
// until the last read.
#pragma once

#include <cstdint>
#include <vector>

namespace strata::net {

class FloatPieces {
 public:
  struct Piece {
    uint64_t first = 0, count = 0;
    const float* data = nullptr;
  };
  // Adds elements [first, first + count) at `data`; false (nothing added)
  // where they overlap a piece held. Empty pieces are not kept.
  bool Add(uint64_t first, uint64_t count, const float* data);
  const std::vector<Piece>& pieces() const { return pieces_; }  // sorted by first, disjoint
  // Elements [at, at + count) where one piece holds them all, else null.
  const float* Find(uint64_t at, uint64_t count) const;
  // dst[0, count) := elements [at, at + count) (zero where no piece holds one).
  void Read(uint64_t at, uint64_t count, float* dst) const;

 private:
  std::vector<Piece>::const_iterator FirstEndingAfter(uint64_t at) const;
  std::vector<Piece> pieces_;
};

}  // namespace strata::net
