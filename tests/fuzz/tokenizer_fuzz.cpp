// The GPT-2 tokenizer's vocabulary readers (encoder.json, vocab.bpe) on arbitrary bytes, and
// the BPE encoder on what they accept. The input is encoder.json, a 0xff byte, vocab.bpe,
// a 0xff byte and a text (0xff never occurs in UTF-8, so the split cannot be ambiguous for
// valid files). Loading must either succeed or throw dtrain::Error; a loaded tokenizer must
// encode the text to ids below its vocabulary size that decode to the text again. Any other
// exception, a crash or a sanitizer report is a bug.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <dtrain/errors.h>

#include "tokenizer.h"

namespace {

[[noreturn]] void bug(const std::string& what) {
  std::fprintf(stderr, "tokenizer_fuzz: %s\n", what.c_str());
  std::abort();
}

// The part of `rest` before the next 0xff byte; `rest` keeps what follows it.
std::string_view take_part(std::string_view& rest) {
  const size_t end = rest.find('\xff');
  const std::string_view part = rest.substr(0, end);
  rest = end == std::string_view::npos ? std::string_view() : rest.substr(end + 1);
  return part;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view rest(reinterpret_cast<const char*>(data), size);
  const std::string_view json = take_part(rest);
  const std::string_view bpe = take_part(rest);
  const std::string_view text = rest;

  std::unique_ptr<gpt2::Gpt2Tokenizer> tokenizer;
  try {
    tokenizer = gpt2::Gpt2Tokenizer::from_text(json, bpe);
  } catch (const dtrain::Error& e) {
    const std::string what = e.cause();
    if (what.rfind("encoder.json", 0) != 0 && what.rfind("vocab.bpe", 0) != 0) {
      bug("message does not start with the file's name: " + what);
    }
    return 0;
  }
  const std::vector<int32_t> ids = tokenizer->encode(text);
  for (const int32_t id : ids) {
    if (id < 0 || id >= tokenizer->vocab_size()) bug("encode gave an id outside the vocabulary");
  }
  if (tokenizer->decode(ids) != text) bug("decode(encode(text)) != text");
  const std::vector<int32_t> documents = gpt2::encode_documents(*tokenizer, text);
  for (const int32_t id : documents) {
    if (id < 0 || id >= tokenizer->vocab_size()) bug("encode_documents gave an id outside");
  }
  return 0;
}
