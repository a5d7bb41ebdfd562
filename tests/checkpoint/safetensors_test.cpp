// The safetensors component (the public dtrain/safetensors.h): round trips for every dtype,
// element and byte ranges at odd offsets, a range read touching only its own pages, the
// exact byte layout of a file written by the reference implementation, and every malformed
// file refused with one line naming the file and the problem. Also the JSON parser and
// CRC-32C under it.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>

#include "checkpoint/safetensors.h"
#include "dtrain/crc32c.h"
#include "dtrain/errors.h"
#include "dtrain/json.h"
#include "dtrain/safetensors.h"
#include "support/temp_dir.h"

namespace dtrain::checkpoint {
namespace {

using testing::TempDir;

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary)
      .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A safetensors file from its header text and data bytes, with a given size prefix.
std::string raw_file(const std::string& header, const std::string& data, uint64_t size_prefix) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((size_prefix >> (8 * i)) & 0xFF);
  return out + header + data;
}
std::string raw_file(const std::string& header, const std::string& data) {
  return raw_file(header, data, header.size());
}

// Expects opening `bytes` as a safetensors file to fail with one line naming the file and
// containing `problem`.
void expect_refused(const std::string& bytes, const std::string& problem) {
  TempDir dir("st_bad");
  const std::string path = dir / "bad.safetensors";
  write_bytes(path, bytes);
  try {
    SafetensorsReader reader(path);
    FAIL() << "accepted a bad file; expected: " << problem;
  } catch (const CheckpointError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(path), std::string::npos) << what;
    EXPECT_NE(what.find(problem), std::string::npos) << what;
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
  }
}

TEST(Crc32c, KnownValueAndHardwareMatchesPortable) {
  const std::string check = "123456789";
  EXPECT_EQ(crc32c(0, check.data(), check.size()), 0xE3069283u);
  EXPECT_EQ(crc32c_portable(0, check.data(), check.size()), 0xE3069283u);
  std::mt19937 gen(3);
  std::string buf(10007, '\0');
  for (auto& c : buf) c = static_cast<char>(gen());
  for (size_t n : {0, 1, 7, 8, 9, 63, 4096, 10007}) {
    EXPECT_EQ(crc32c(0, buf.data(), n), crc32c_portable(0, buf.data(), n)) << n;
  }
  // Continuation equals one pass.
  const uint32_t a = crc32c(crc32c(0, buf.data(), 1000), buf.data() + 1000, 9007);
  EXPECT_EQ(a, crc32c(0, buf.data(), buf.size()));
}

TEST(Json, RoundTripAndEscapes) {
  const std::string text =
      R"({"a":1,"b":[true,false,null,-2.5,"x\"y\\z\n"],"c":{"e\u00e9":"\ud83d\ude00"},"big":9007199254740993})";
  Json j = Json::parse(text);
  EXPECT_EQ(j.at("a").as_int(), 1);
  EXPECT_EQ(j.at("big").as_int(), 9007199254740993LL);  // exact, not through a double
  EXPECT_EQ(j.at("b").as_array()[3].as_double(), -2.5);
  EXPECT_EQ(j.at("b").as_array()[4].as_string(), "x\"y\\z\n");
  EXPECT_EQ(j.at("c").at("e\xc3\xa9").as_string(), "\xf0\x9f\x98\x80");
  EXPECT_EQ(Json::parse(j.dump()).dump(), j.dump());
  EXPECT_EQ(Json(2.0).dump(), "2.0");
  EXPECT_EQ(Json::parse(Json(0.1).dump()).as_double(), 0.1);
}

TEST(Json, RefusesMalformedText) {
  for (const char* bad :
       {"", "{", "{\"a\":1,}", "{\"a\":1} x", "{\"a\":1,\"a\":2}", "[01]", "\"\\q\"", "\"\\ud800\"",
        "\"abc", "99999999999999999999", "{a:1}", "[1 2]", "nul", "\"a\x01\""}) {
    EXPECT_THROW(Json::parse(bad), JsonError) << bad;
  }
  std::string deep(100, '[');
  deep += std::string(100, ']');
  EXPECT_THROW(Json::parse(deep), JsonError);
}

// Every dtype the format names.
constexpr c10::ScalarType kAllDtypes[] = {at::kFloat, at::kHalf, at::kBFloat16, at::kDouble,
                                          at::kLong,  at::kInt,  at::kShort,    at::kChar,
                                          at::kByte,  at::kBool};

TEST(Safetensors, RoundTripEveryDtype) {
  TempDir dir("st");
  const std::string path = dir / "all.safetensors";
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  at::manual_seed(0);
  for (auto dt : kAllDtypes) {
    at::Tensor t = (at::randn({3, 5}) * 50).to(dt);
    tensors.emplace_back(std::string("t.") + safetensors_dtype_name(dt), t);
  }
  tensors.emplace_back("scalar", at::tensor(3.5));
  tensors.emplace_back("empty", at::zeros({0, 4}));
  tensors.emplace_back("strided", at::arange(12, at::kFloat).view({3, 4}).t());  // not contiguous
  const FileDigest digest = write_safetensors(path, tensors, {{"format", "pt"}, {"k", "v\"q"}});
  EXPECT_EQ(digest.size, std::filesystem::file_size(path));

  SafetensorsReader r(path);
  EXPECT_EQ(r.metadata().at("format"), "pt");
  EXPECT_EQ(r.metadata().at("k"), "v\"q");
  ASSERT_EQ(r.tensors().size(), tensors.size());
  EXPECT_EQ(r.tensors()[0].begin % 8, 0u);  // the data section starts 8-byte aligned
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, want] = tensors[i];
    EXPECT_EQ(r.tensors()[i].name, name);  // written order kept
    at::Tensor got = r.read(name);
    EXPECT_EQ(got.scalar_type(), want.scalar_type()) << name;
    EXPECT_EQ(got.sizes(), want.sizes()) << name;
    EXPECT_TRUE(at::equal(got, want.contiguous())) << name;
  }
  // A byte range of one tensor.
  const auto* f = r.find("t.F32");
  ASSERT_NE(f, nullptr);
  float two[2];
  r.read_bytes(*f, 4 * 4, two, sizeof(two));
  EXPECT_EQ(two[0], tensors[0].second.view({-1})[4].item<float>());
  EXPECT_EQ(two[1], tensors[0].second.view({-1})[5].item<float>());
  EXPECT_THROW(r.read_bytes(*f, 14 * 4, two, sizeof(two)), CheckpointError);
  EXPECT_THROW(r.read("missing"), CheckpointError);
}

// The public API alone: every dtype through dtrain::write_safetensors and back, whole and
// in element and byte ranges that start and end at odd offsets.
TEST(Safetensors, PublicRoundTripEveryDtypeWholeAndInRanges) {
  TempDir dir("st_pub");
  const std::string path = dir / "all.safetensors";
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  at::manual_seed(1);
  for (auto dt : kAllDtypes) {
    tensors.emplace_back(std::string("t.") + dtrain::safetensors_dtype_name(dt),
                         (at::randn({7, 11}) * 50).to(dt));
  }
  dtrain::write_safetensors(path, tensors, {{"format", "pt"}});
  dtrain::SafetensorsReader r(path);
  EXPECT_EQ(r.path(), path);
  EXPECT_EQ(r.metadata().at("format"), "pt");
  ASSERT_EQ(r.tensors().size(), tensors.size());
  for (const auto& [name, want] : tensors) {
    const dtrain::SafetensorsTensor& t = r.at(name);
    EXPECT_EQ(dtrain::safetensors_dtype(dtrain::safetensors_dtype_name(t.dtype)), t.dtype);
    EXPECT_EQ(t.shape, (std::vector<int64_t>{7, 11})) << name;
    EXPECT_EQ(t.nbytes(), 77 * want.element_size()) << name;
    EXPECT_TRUE(at::equal(r.read(name), want)) << name;
    const at::Tensor flat = want.reshape({-1});
    for (const auto& [b, e] :
         {std::pair<int64_t, int64_t>{1, 4}, {3, 76}, {13, 14}, {0, 77}, {76, 77}, {5, 5}}) {
      const at::Tensor got = r.read_elements(name, b, e);
      EXPECT_EQ(got.scalar_type(), want.scalar_type()) << name;
      EXPECT_TRUE(at::equal(got, flat.narrow(0, b, e - b)))
          << name << " [" << b << ", " << e << ")";
    }
    // Bytes at an odd offset, of an odd length: exactly the bytes of the tensor there.
    const size_t item = want.element_size();
    std::string got(9, '\0');
    r.read_bytes(t, 3, got.data(), got.size());
    EXPECT_EQ(std::memcmp(got.data(), static_cast<const char*>(flat.data_ptr()) + 3, 9), 0) << name;
    EXPECT_THROW(r.read_elements(name, 70, 78), CheckpointError) << name;
    EXPECT_THROW(r.read_elements(name, -1, 2), CheckpointError) << name;
    EXPECT_THROW(r.read_bytes(t, 77 * item - 2, got.data(), 3), CheckpointError) << name;
  }
  try {
    r.at("missing");
    FAIL() << "a missing tensor was found";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find(path + ": no tensor named \"missing\""), std::string::npos)
        << e.what();
  }
}

// Resident file-backed pages of this process (KiB), from /proc/self/status.
int64_t rss_file_kib() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("RssFile:", 0) == 0) return std::stoll(line.substr(8));
  }
  return -1;
}

// Strided small reads (a transposed shard's) touch every page of a tensor; release() takes
// them out of the resident set again, and the tensor still reads back whole.
TEST(Safetensors, ReleaseDropsATensorsPagesFromTheResidentSet) {
  if (rss_file_kib() < 0) GTEST_SKIP() << "no RssFile in /proc/self/status";
  TempDir dir("st_release");
  const std::string path = dir / "big.safetensors";
  const at::Tensor want = at::arange(int64_t{4} << 20, at::kFloat);  // 16 MiB
  dtrain::write_safetensors(path, {{"big", want}});
  dtrain::SafetensorsReader r(path);
  const dtrain::SafetensorsTensor& t = r.at("big");
  const int64_t before = rss_file_kib();
  char buf[4];
  for (uint64_t off = 0; off + sizeof buf <= t.nbytes(); off += 4096) {
    r.read_bytes(t, off, buf, sizeof buf);
  }
  const int64_t touched = rss_file_kib();
  EXPECT_GE(touched - before, 15 * 1024) << "the strided reads should map the whole tensor";
  r.release(t);
  EXPECT_LE(rss_file_kib() - before, 1024) << "release left the tensor's pages resident";
  EXPECT_TRUE(at::equal(r.read("big"), want));
}

// A real file cut short, or with a corrupted header, is refused at open with the file's name.
TEST(Safetensors, TruncatedOrCorruptFileIsRefusedNamingTheFile) {
  TempDir dir("st_cut");
  const std::string path = dir / "cut.safetensors";
  dtrain::write_safetensors(path, {{"a", at::arange(1000, at::kFloat)}, {"b", at::ones({10})}});
  auto expect_refused_file = [&](const std::string& problem) {
    try {
      dtrain::SafetensorsReader reader(path);
      FAIL() << "accepted; expected: " << problem;
    } catch (const CheckpointError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(path + ": not a valid safetensors file: "), std::string::npos) << what;
      EXPECT_NE(what.find(problem), std::string::npos) << what;
    }
  };
  const auto size = std::filesystem::file_size(path);
  std::filesystem::resize_file(path, size - 1);
  expect_refused_file("tensor \"b\": data_offsets [4000, 4040] run past the data section");
  std::filesystem::resize_file(path, 20);  // inside the header
  expect_refused_file("runs past the end of the file");
  dtrain::write_safetensors(path, {{"a", at::arange(1000, at::kFloat)}});
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(8);
    f.put('[');  // the header's '{'
  }
  expect_refused_file("header does not start with '{'");
}

// Reading a range of a tensor touches only that range: every other page of the mapping is
// made unreadable before the read (a touch outside the range would kill the process with
// SIGSEGV), and the reader counts exactly the bytes asked for.
TEST(SafetensorsDeathTest, ReadingARangeTouchesOnlyThatRange) {
  TempDir dir("st_range");
  const std::string path = dir / "three.safetensors";
  const int64_t n = 1 << 18;  // 1 MiB of fp32 per tensor
  dtrain::write_safetensors(
      path,
      {{"a", at::full({n}, 1.0f)}, {"b", at::arange(n, at::kFloat)}, {"c", at::full({n}, 3.0f)}});
  dtrain::SafetensorsReader r(path);
  const dtrain::SafetensorsTensor& b = r.at("b");
  const int64_t lo = 100'003, hi = 150'001;  // odd element offsets
  const at::Tensor want = at::arange(lo, hi, at::kFloat);

  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t file_size = std::filesystem::file_size(path);
  auto* base = static_cast<uint8_t*>(const_cast<void*>(r.mapped_data(b))) - b.begin;
  const uint64_t first = (b.begin + lo * 4) / page * page;
  const uint64_t last = (b.begin + hi * 4 + page - 1) / page * page;
  const uint64_t mapped = (file_size + page - 1) / page * page;
  ASSERT_GT(first, 0u);
  ASSERT_LT(last, mapped);
  EXPECT_EXIT(
      {
        if (::mprotect(base, first, PROT_NONE) != 0 ||
            ::mprotect(base + last, mapped - last, PROT_NONE) != 0) {
          std::_Exit(2);
        }
        const at::Tensor got = r.read_elements("b", lo, hi);
        float odd[2];
        r.read_bytes(b, lo * 4 + 4, odd, sizeof(odd));
        const bool ok = at::equal(got, want) && odd[0] == static_cast<float>(lo + 1) &&
                        odd[1] == static_cast<float>(lo + 2);
        std::_Exit(ok ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "");
  // And in this process: the bytes asked for, nothing more.
  EXPECT_EQ(r.bytes_read(), 0u);
  EXPECT_TRUE(at::equal(r.read_elements("b", lo, hi), want));
  EXPECT_EQ(r.bytes_read(), static_cast<uint64_t>(hi - lo) * 4);
}

TEST(Safetensors, ReadsTheReferenceLayout) {
  // What huggingface's safetensors writes for {"test": torch.zeros(2, 2, dtype=int32)}
  // (the header padded with spaces to a multiple of 8).
  const std::string header = R"({"test":{"dtype":"I32","shape":[2,2],"data_offsets":[0,16]}})";
  std::string padded = header + std::string((8 - header.size() % 8) % 8, ' ');
  std::string data(16, '\0');
  data[4] = 7;  // element [0, 1] = 7
  TempDir dir("st_ref");
  write_bytes(dir / "ref.safetensors", raw_file(padded, data));
  SafetensorsReader r(dir / "ref.safetensors");
  at::Tensor t = r.read("test");
  EXPECT_EQ(t.scalar_type(), at::kInt);
  EXPECT_TRUE(at::equal(t, at::tensor({0, 7, 0, 0}, at::kInt).view({2, 2})));
  // And dtrain writes the same bytes for the same tensor.
  write_safetensors(dir / "ours.safetensors", {{"test", t.zero_()}});
  std::ifstream in(dir / "ours.safetensors", std::ios::binary);
  std::string ours((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(ours, raw_file(padded, std::string(16, '\0')));
}

TEST(Safetensors, RefusesBadFiles) {
  const std::string ok_entry = R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  const std::string d8(8, '\0');
  expect_refused("", "0 bytes, shorter than the 8-byte header size");
  expect_refused("abc", "shorter than the 8-byte header size");
  expect_refused(raw_file("{" + ok_entry + "}", d8, 4096), "runs past the end of the file");
  expect_refused(raw_file("{}", "", 200'000'000), "exceeds the 100000000-byte limit");
  expect_refused(raw_file("[1,2]", ""), "header does not start with '{'");
  expect_refused(raw_file("{\"a\":", ""), "header: invalid JSON");
  expect_refused(raw_file("{" + ok_entry + ",\"a\":{}}", d8), "duplicate key");
  expect_refused(raw_file(R"({"a":{"dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2]}})", "xx"),
                 "tensor \"a\": unsupported dtype \"F8_E4M3\"");
  expect_refused(raw_file(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", d8),
                 "negative dimension");
  expect_refused(raw_file(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", d8),
                 "data_offsets [0, 8] hold 8 bytes but F32 [3] needs 12");
  expect_refused(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", d8),
                 "are not a range");
  expect_refused(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", d8),
                 "data_offsets must hold [begin, end]");
  expect_refused(raw_file(R"({"a":{"dtype":"F32","shape":[2]}})", d8),
                 "missing key \"data_offsets\"");
  expect_refused(raw_file(R"({"a":{"dtype":"F32","shape":"2","data_offsets":[0,8]}})", d8),
                 "expected a JSON array");
  expect_refused(raw_file(R"({"a":[1]})", d8), "tensor \"a\": is not an object");
  expect_refused(raw_file("{" + ok_entry + "}", "\0\0\0\0"), "run past the data section");
  expect_refused(raw_file("{" + ok_entry + "}", d8 + "xx"), "2 bytes after the last tensor");
  expect_refused(
      raw_file("{" + ok_entry + R"(,"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
               std::string(12, '\0')),
      "tensors \"a\" and \"b\" overlap");
  expect_refused(raw_file(R"({"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", d8),
                 "4 unused bytes before tensor \"b\"");
  expect_refused(raw_file(R"({"__metadata__":{"x":1}})", ""),
                 "__metadata__ value of \"x\" is not a string");
  expect_refused(raw_file(R"({"__metadata__":[]})", ""), "__metadata__ is not an object");
  expect_refused(
      raw_file(R"({"a":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,8]}})", d8),
      "shape too large");
  // A file that is not there.
  try {
    SafetensorsReader reader("/nonexistent/x.safetensors");
    FAIL();
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/x.safetensors: cannot open"),
              std::string::npos)
        << e.what();
  }
}

TEST(Safetensors, WriterRefusesWhatItCannotRepresent) {
  TempDir dir("st_w");
  EXPECT_THROW(write_safetensors(dir / "x", {{"a", at::zeros({1})}, {"a", at::zeros({1})}}),
               InvalidArgument);
  EXPECT_THROW(write_safetensors(dir / "x", {{"__metadata__", at::zeros({1})}}), InvalidArgument);
  EXPECT_THROW(write_safetensors(dir / "x", {{"c", at::zeros({1}, at::kComplexFloat)}}),
               InvalidArgument);
}

}  // namespace
}  // namespace dtrain::checkpoint
