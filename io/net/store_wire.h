// The store's wire format (internal to io/net). Every message is a frame:
// u32 body length (little endian), then the body.
//   request: u8 op, u64 wait_ms, u32 nkeys, nkeys x (u32 len, bytes), u32 len, value bytes
//   reply:   u8 status, u32 len, payload bytes
// GET waits for keys[0] and returns its value; WAIT waits for every key; ADD
// carries the delta as decimal text and returns the new value the same way;
// a TIMEOUT reply's payload lists the missing keys.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace strata::net::wire {

enum class Op : uint8_t { kSet = 1, kGet = 2, kAdd = 3, kWait = 4 };
enum class Reply : uint8_t { kOk = 0, kTimeout = 1, kInvalid = 2 };

constexpr uint32_t kMaxFrame = 256u << 20;  // refuse garbage lengths

struct Request {
  Op op = Op::kSet;
  uint64_t wait_ms = 0;
  std::vector<std::string> keys;
  std::vector<uint8_t> value;
};

struct Response {
  Reply status = Reply::kOk;
  std::vector<uint8_t> payload;
};

// Encoders return a whole frame (length prefix included).
std::vector<uint8_t> EncodeRequest(const Request& r);
std::vector<uint8_t> EncodeResponse(const Response& r);
// Decoders take a body (no length prefix); nullopt when malformed.
std::optional<Request> DecodeRequest(const std::vector<uint8_t>& body);
std::optional<Response> DecodeResponse(const std::vector<uint8_t>& body);
uint32_t DecodeLength(const uint8_t* four_bytes);

}  // namespace strata::net::wire
