// The config document's JSON layer: a checked parse (nlohmann's SAX parser
// feeding its own DOM builder, with the checks a config needs that plain
// parsing lacks) and bounded descriptions of values for error messages.
#include <limits>
#include <set>
#include <vector>

#include "engine/config/config_reader.h"

namespace strata::config_internal {
namespace {

constexpr size_t kBriefChars = 40;  // of a value in an error message
constexpr size_t kKeyChars = 64;    // of one key in a key path

std::string PositionOf(std::string_view text, size_t byte) {
  size_t line = 1, column = 1;
  for (size_t i = 0; i < byte && i < text.size(); ++i) {
    if (text[i] == '\n') ++line, column = 1;
    else ++column;
  }
  return "line " + std::to_string(line) + ", column " + std::to_string(column) + " (byte " +
         std::to_string(byte) + ")";
}

// The first `n` bytes of `s`, or fewer so as not to split a UTF-8 sequence
// (a split one made nlohmann's dump throw; the fuzzer found it).
std::string CutUtf8(std::string_view s, size_t n) {
  if (s.size() <= n) return std::string(s);
  while (n > 0 && (static_cast<unsigned char>(s[n]) & 0xC0) == 0x80) --n;
  return std::string(s.substr(0, n));
}

// JSON text of a string; bytes that are not UTF-8 become U+FFFD, never an exception.
std::string DumpString(std::string_view s) {
  return Json(std::string(s)).dump(-1, ' ', false, Json::error_handler_t::replace);
}

// Appends `v` as JSON to *out, stopping once *out holds more than `limit`
// characters: no value, however large or deep, costs more than that.
void AppendBrief(const Json& v, size_t limit, std::string* out) {
  if (out->size() > limit) return;
  if (v.is_string()) {
    const std::string& s = v.get_ref<const std::string&>();
    *out += DumpString(CutUtf8(s, limit + 1));  // the cut is trimmed by the caller
  } else if (v.is_object()) {
    *out += '{';
    for (auto it = v.begin(); it != v.end() && out->size() <= limit; ++it) {
      if (it != v.begin()) *out += ',';
      *out += DumpString(CutUtf8(it.key(), limit + 1)) + ':';
      AppendBrief(it.value(), limit, out);
    }
    *out += '}';
  } else if (v.is_array()) {
    *out += '[';
    for (size_t i = 0; i < v.size() && out->size() <= limit; ++i) {
      if (i) *out += ',';
      AppendBrief(v[i], limit, out);
    }
    *out += ']';
  } else {
    *out += v.dump();  // a scalar: a few characters
  }
}

// Builds the DOM through nlohmann's own SAX builder and refuses, naming the
// key path: nesting deeper than kMaxConfigDepth (a document nested 100k deep
// used to overflow the stack in code that walks values recursively), a key
// given twice in one object (the parser would keep the last silently), and
// numbers that overflow a double (nlohmann reports them with an exception
// type that its parse_error handling does not cover).
class CheckedSax {
 public:
  CheckedSax(std::string_view text, Json* root) : text_(text), dom_(*root, /*allow_exceptions=*/false) {}
  const Status& status() const { return status_; }

  bool null() { return Value() && dom_.null(); }
  bool boolean(bool b) { return Value() && dom_.boolean(b); }
  bool number_integer(Json::number_integer_t n) { return Value() && dom_.number_integer(n); }
  bool number_unsigned(Json::number_unsigned_t n) { return Value() && dom_.number_unsigned(n); }
  bool number_float(Json::number_float_t n, const std::string& s) { return Value() && dom_.number_float(n, s); }
  bool string(std::string& s) { return Value() && dom_.string(s); }
  bool binary(Json::binary_t& b) { return Value() && dom_.binary(b); }
  bool start_object(size_t n) { return Open(false) && dom_.start_object(n); }
  bool start_array(size_t n) { return Open(true) && dom_.start_array(n); }
  bool end_object() { return Close() && dom_.end_object(); }
  bool end_array() { return Close() && dom_.end_array(); }

  bool key(std::string& k) {
    Frame& f = frames_.back();
    f.key = k;
    if (!f.keys.insert(k).second) return Fail(ConfigError(Path() + ": duplicate key; give each key once"));
    return dom_.key(k);
  }

  template <class Exception>
  bool parse_error(size_t byte, const std::string& /*token*/, const Exception& e) {
    std::string what = e.what();  // "[json.exception.<kind>.<id>] <message>"
    const size_t tag = what.find("] ");
    if (tag != std::string::npos) what = what.substr(tag + 2);
    const std::string at = PositionOf(text_, byte > 0 ? byte - 1 : 0);
    if (e.id == 406) {  // "number overflow parsing '1e400'": the value of the key being read
      Value();
      return Fail(ConfigError((frames_.empty() ? "config" : Path()) + ": " + BriefKey(what) + " at " + at +
                              "; allowed: a finite number"));
    }
    const size_t colon = what.find(": ");  // drop "parse error at line 1, column 2: "; ours says where
    if (colon != std::string::npos) what = what.substr(colon + 2);
    return Fail(ConfigError("invalid JSON at " + at + ": " + what));
  }

 private:
  struct Frame {
    bool array = false;
    size_t next_index = 0;  // array: elements seen
    std::string key;        // object: the key being read
    std::set<std::string> keys;
  };

  // The path of the value being read, e.g. "optimizer.params.betas[1]".
  std::string Path() const {
    std::string out;
    for (const Frame& f : frames_) {
      if (f.array) {
        out += "[" + std::to_string(f.next_index == 0 ? 0 : f.next_index - 1) + "]";
        continue;
      }
      if (!out.empty()) out += '.';
      out += BriefKey(f.key);
    }
    return out;
  }
  bool Fail(Status s) {
    if (status_.ok()) status_ = std::move(s);
    return false;
  }
  bool Value() {
    if (!frames_.empty() && frames_.back().array) ++frames_.back().next_index;
    return true;
  }
  bool Open(bool array) {
    Value();
    if (frames_.size() >= kMaxConfigDepth)
      return Fail(ConfigError((frames_.empty() ? "config" : Path()) + ": nested deeper than " +
                              std::to_string(kMaxConfigDepth) + " levels; allowed: at most " +
                              std::to_string(kMaxConfigDepth)));
    frames_.push_back(Frame{array, 0, {}, {}});
    return true;
  }
  bool Close() {
    frames_.pop_back();
    return true;
  }

  std::string_view text_;
  nlohmann::detail::json_sax_dom_parser<Json> dom_;
  std::vector<Frame> frames_;
  Status status_;
};

}  // namespace

std::string BriefJson(const Json& v) {
  std::string text;
  AppendBrief(v, kBriefChars, &text);
  if (text.size() > kBriefChars) text = CutUtf8(text, kBriefChars - 3) + "...";
  return text;
}

std::string BriefKey(std::string_view key) {
  if (key.size() <= kKeyChars) return std::string(key);
  return CutUtf8(key, kKeyChars - 3) + "...";
}

std::string DescribeJson(const Json& v) {
  const std::string text = BriefJson(v);
  if (v.is_string()) return "string " + text;
  if (v.is_number()) return "number " + text;
  if (v.is_boolean()) return "boolean " + text;
  if (v.is_array()) return "array " + text;
  if (v.is_object()) return "object " + text;
  return text;
}

Result<Json> ParseConfigJson(std::string_view text) {
  Json doc;
  CheckedSax sax(text, &doc);
  try {
    if (Json::sax_parse(text.begin(), text.end(), &sax)) return doc;
  } catch (const std::exception& e) {  // allocation failures; nothing else throws with exceptions off
    return ConfigError(std::string("config: cannot parse: ") + e.what());
  }
  if (!sax.status().ok()) return sax.status();
  return ConfigError("config: invalid JSON");  // not reached: every refusal sets a status
}

}  // namespace strata::config_internal
