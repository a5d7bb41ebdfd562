#include "checkpoint/directory.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include <fmt/format.h>

#include "dtrain/crc32c.h"
#include "dtrain/errors.h"

namespace dtrain::checkpoint {
namespace fs = std::filesystem;
namespace {

constexpr const char* kMagic = "dtrain-checkpoint";

// "step_000000120" -> 120; -1 for anything else.
int64_t parse_step(const std::string& name) {
  if (name.rfind("step_", 0) != 0 || name.size() <= 5) return -1;
  int64_t v = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9' || v > (INT64_MAX - 9) / 10) return -1;
    v = v * 10 + (name[i] - '0');
  }
  return v;
}

void rename_or_throw(const std::string& from, const std::string& to) {
  if (std::rename(from.c_str(), to.c_str()) != 0) {
    throw CheckpointError(
        fmt::format("{}: cannot rename to {}: {}", from, to, std::strerror(errno)));
  }
}

}  // namespace

std::string step_dir_name(int64_t step) { return fmt::format("step_{:09d}", step); }

std::vector<std::pair<int64_t, std::string>> complete_checkpoints(const std::string& dir) {
  std::vector<std::pair<int64_t, std::string>> out;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return out;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const int64_t step = parse_step(entry.path().filename().string());
    if (step < 0 || !fs::is_regular_file(entry.path() / kManifestName, ec)) continue;
    out.emplace_back(step, entry.path().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string latest_complete(const std::string& dir) {
  auto all = complete_checkpoints(dir);
  return all.empty() ? std::string() : all.back().second;
}

void write_manifest(const std::string& checkpoint_path, const Json& manifest) {
  const std::string json = manifest.dump();
  const std::string text = fmt::format("{} {} crc32c={:08x}\n{}\n", kMagic, kFormatVersion,
                                       crc32c(0, json.data(), json.size()), json);
  write_small_file((fs::path(checkpoint_path) / kManifestName).string(), text);
}

Json read_manifest(const std::string& checkpoint_path) {
  const std::string path = (fs::path(checkpoint_path) / kManifestName).string();
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    throw CheckpointError(
        fmt::format("{}: missing: {} is not a complete dtrain checkpoint", path, checkpoint_path));
  }
  const std::string text = read_small_file(path, kMaxManifestBytes);
  const size_t eol = text.find('\n');
  const std::string first = text.substr(0, eol);
  char magic[32] = {0};
  int version = 0;
  unsigned crc = 0;
  if (eol == std::string::npos ||
      std::sscanf(first.c_str(), "%31s %d crc32c=%8x", magic, &version, &crc) != 3 ||
      std::string(magic) != kMagic) {
    throw CheckpointError(fmt::format("{}: not a dtrain checkpoint manifest (foreign file)", path));
  }
  if (version != kFormatVersion) {
    throw CheckpointError(fmt::format("{}: format version {}, this build reads version {}", path,
                                      version, kFormatVersion));
  }
  std::string json = text.substr(eol + 1);
  if (!json.empty() && json.back() == '\n') json.pop_back();
  if (crc32c(0, json.data(), json.size()) != crc) {
    throw CheckpointError(fmt::format("{}: checksum mismatch: the manifest is corrupted", path));
  }
  try {
    Json j = Json::parse(json);
    if (!j.is_object()) throw JsonError("not an object");
    return j;
  } catch (const JsonError& e) {
    throw CheckpointError(fmt::format("{}: unreadable manifest: {}", path, e.cause()));
  }
}

std::string temp_path(const std::string& dir, int64_t step) {
  return (fs::path(dir) / (".tmp-" + step_dir_name(step))).string();
}

std::string prepare_temp(const std::string& dir, int64_t step) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw CheckpointError(fmt::format("{}: cannot create: {}", dir, ec.message()));
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(".tmp-", 0) == 0 || name.rfind(".trash-", 0) == 0) {
      fs::remove_all(entry.path(), ec);
    }
  }
  const std::string tmp = temp_path(dir, step);
  if (!fs::create_directory(tmp, ec) || ec) {
    throw CheckpointError(fmt::format("{}: cannot create: {}", tmp, ec.message()));
  }
  return tmp;
}

std::string commit_temp(const std::string& dir, int64_t step,
                        const std::function<void(const char*)>& on_progress) {
  const std::string tmp = temp_path(dir, step);
  const std::string final_path = (fs::path(dir) / step_dir_name(step)).string();
  fsync_directory(tmp);
  std::error_code ec;
  if (fs::exists(final_path, ec)) {
    // Saving a step again (e.g. after a resume): the older copy goes to the trash first.
    const std::string trash = (fs::path(dir) / (".trash-" + step_dir_name(step))).string();
    fs::remove_all(trash, ec);
    rename_or_throw(final_path, trash);
  }
  if (on_progress) on_progress("before_rename");
  rename_or_throw(tmp, final_path);
  fsync_directory(dir);
  if (on_progress) on_progress("renamed");
  return final_path;
}

void prune(const std::string& dir, int keep) {
  auto all = complete_checkpoints(dir);
  std::error_code ec;
  for (size_t i = 0; i + static_cast<size_t>(std::max(keep, 1)) < all.size(); ++i) {
    const fs::path p(all[i].second);
    const std::string trash = (p.parent_path() / (".trash-" + p.filename().string())).string();
    fs::remove_all(trash, ec);
    rename_or_throw(p.string(), trash);
    fs::remove_all(trash, ec);
  }
  fsync_directory(dir);
}

FileDigest digest_from_json(const Json& j) {
  FileDigest d;
  d.size = static_cast<uint64_t>(j.at("size").as_int());
  d.chunk_bytes = static_cast<uint64_t>(j.at("chunk_bytes").as_int());
  if (d.chunk_bytes == 0) throw JsonError("chunk_bytes is 0");
  for (const auto& c : j.at("crc32c").as_array()) {
    d.chunk_crcs.push_back(static_cast<uint32_t>(std::stoul(c.as_string(), nullptr, 16)));
  }
  return d;
}

Json digest_to_json(const FileDigest& d) {
  Json j = Json::object();
  j.set("size", static_cast<int64_t>(d.size));
  j.set("chunk_bytes", static_cast<int64_t>(d.chunk_bytes));
  Json::Array crcs;
  for (uint32_t c : d.chunk_crcs) crcs.emplace_back(fmt::format("{:08x}", c));
  j.set("crc32c", Json(std::move(crcs)));
  return j;
}

}  // namespace dtrain::checkpoint
