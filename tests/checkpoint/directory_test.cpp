// The checkpoint directory layer: manifests (foreign, other version, corrupted), checksums
// verified on read (truncated, flipped byte, only the touched chunks read), discovery of the
// latest complete checkpoint, keep-K pruning, and a writer process SIGKILLed at every point
// of a save leaving the previous checkpoint loadable.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include "checkpoint/directory.h"
#include "checkpoint/files.h"
#include "checkpoint/safetensors.h"
#include "dtrain/errors.h"
#include "support/ranks.h"
#include "support/temp_dir.h"

namespace dtrain::checkpoint {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}
void spit(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// Runs `fn` and expects a CheckpointError whose one-line message contains every `parts`.
template <typename Fn>
void expect_error(Fn fn, std::initializer_list<std::string> parts) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected: " << *parts.begin();
  } catch (const CheckpointError& e) {
    const std::string what = e.what();
    for (const auto& p : parts) EXPECT_NE(what.find(p), std::string::npos) << what;
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
  }
}

TEST(CheckpointManifest, RoundTripAndRefusals) {
  TempDir dir("manifest");
  const std::string ck = dir.path().string();
  Json m = Json::object();
  m.set("step", 7);
  m.set("name", "x");
  write_manifest(ck, m);
  EXPECT_EQ(read_manifest(ck).dump(), m.dump());

  const std::string path = dir / "MANIFEST";
  const std::string good = slurp(path);
  std::string flipped = good;
  flipped[flipped.size() - 3] ^= 0x01;
  spit(path, flipped);
  expect_error([&] { read_manifest(ck); }, {path, "checksum mismatch"});
  spit(path, "{\"step\": 7}\n");
  expect_error([&] { read_manifest(ck); }, {path, "foreign file"});
  std::string v2 = good;
  v2.replace(v2.find(" 1 "), 3, " 2 ");
  spit(path, v2);
  expect_error([&] { read_manifest(ck); }, {path, "format version 2, this build reads version 1"});
  fs::remove(path);
  expect_error([&] { read_manifest(ck); }, {path, "missing"});
}

TEST(CheckpointFiles, VerifiedReadsRefuseTruncationAndCorruption) {
  TempDir dir("verified");
  const std::string path = dir / "f.bin";
  std::string bytes(3 * kChunkBytes + 100, '\0');
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i * 7);
  FileDigest d = write_small_file(path, bytes);
  ASSERT_EQ(d.chunk_crcs.size(), 4u);
  {
    VerifiedFile f(path, d);
    char buf[10];
    f.read(2 * kChunkBytes + 5, buf, sizeof(buf));  // one chunk touched
    EXPECT_EQ(std::string(buf, 10), bytes.substr(2 * kChunkBytes + 5, 10));
    EXPECT_EQ(f.bytes_read(), kChunkBytes);  // only that chunk was read (and verified)
  }
  std::string corrupt = bytes;
  corrupt[kChunkBytes + 17] ^= 0x40;
  spit(path, corrupt);
  {
    VerifiedFile f(path, d);
    char c;
    f.read(0, &c, 1);  // chunk 0 is intact
    expect_error([&] { f.read(kChunkBytes + 3, &c, 1); },
                 {path, "checksum mismatch in bytes [1048576, 2097152)"});
  }
  spit(path, bytes.substr(0, bytes.size() - 1));
  expect_error([&] { VerifiedFile(path, d); }, {path, "truncated", "the manifest records"});
  spit(path, bytes + "x");
  expect_error([&] { VerifiedFile(path, d); }, {path, "size differs"});
}

Json step_manifest(int64_t step) {
  Json m = Json::object();
  m.set("step", step);
  return m;
}

TEST(CheckpointDirectory, LatestCompleteAndKeep) {
  TempDir dir("ckdir");
  const std::string d = dir.path().string();
  EXPECT_EQ(latest_complete(d + "/none"), "");
  for (int64_t step : {5, 10, 15}) {
    const std::string tmp = prepare_temp(d, step);
    write_manifest(tmp, step_manifest(step));
    EXPECT_EQ(commit_temp(d, step), d + "/" + step_dir_name(step));
    prune(d, 2);
  }
  auto all = complete_checkpoints(d);
  ASSERT_EQ(all.size(), 2u);  // keep 2
  EXPECT_EQ(all[0].first, 10);
  EXPECT_EQ(latest_complete(d), d + "/step_000000015");
  // In-progress, trashed and manifest-less directories are never candidates.
  fs::create_directories(d + "/.tmp-step_000000020");
  write_manifest(d + "/.tmp-step_000000020", step_manifest(20));
  fs::create_directories(d + "/step_000000030");  // no MANIFEST: incomplete
  fs::create_directories(d + "/step_x");
  EXPECT_EQ(latest_complete(d), d + "/step_000000015");
  // Saving the same step again replaces it; the next prepare removes leftovers.
  write_manifest(prepare_temp(d, 15), step_manifest(150));
  EXPECT_FALSE(fs::exists(d + "/.tmp-step_000000020"));
  commit_temp(d, 15);
  EXPECT_EQ(read_manifest(latest_complete(d)).at("step").as_int(), 150);
}

// A writer process killed at each point of its second save: the first checkpoint stays
// the latest and loads (verified) until the rename; after it, the second one does.
TEST(CheckpointDirectory, WriterKilledAtAnyPointLeavesAPreviousCheckpoint) {
  for (const std::string point :
       {"tmp_created", "mid_file", "files_written", "before_rename", "renamed"}) {
    SCOPED_TRACE(point);
    TempDir dir("ckkill");
    const std::string d = dir / "ckpts";
    auto env = testing::rank_env(0, 1, testing::free_port());
    env["DTRAIN_TEST_PAUSE_AT"] = point;
    auto p = testing::spawn_process({DTRAIN_TEST_WORKER, "checkpoint_writer", "10000", d}, env);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (!fs::exists(dir / "paused") && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ::kill(p.pid, SIGKILL);
    auto r = testing::wait_process(p, 30);
    ASSERT_EQ(r.signal, SIGKILL) << r.output;
    const int64_t want = point == "renamed" ? 2 : 1;
    const std::string latest = latest_complete(d);
    ASSERT_EQ(latest, d + "/" + step_dir_name(want));
    Json m = read_manifest(latest);
    EXPECT_EQ(m.at("step").as_int(), want);
    auto reader = SafetensorsAccess::open(std::make_unique<VerifiedFile>(
        latest + "/data.safetensors", digest_from_json(m.at("files").at("data.safetensors"))));
    for (const auto& t : reader.tensors()) {
      EXPECT_TRUE(reader.read(t.name).eq(static_cast<float>(want)).all().item<bool>()) << t.name;
    }
  }
}

}  // namespace
}  // namespace dtrain::checkpoint
