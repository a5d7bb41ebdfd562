// The checkpoint directory: how a checkpoint becomes visible only when complete.
//
//   DIR/step_000000120/MANIFEST           one complete checkpoint (its MANIFEST is written last)
//   DIR/step_000000120/*.safetensors      the data files the manifest lists, with checksums
//   DIR/.tmp-step_000000140/              a save in progress (or killed): never loaded
//   DIR/.trash-step_000000100/            an old checkpoint being removed: never loaded
//
// A save writes everything into .tmp-step_N, fsyncs every file and the directory, then
// renames it to step_N and fsyncs DIR. rename(2) of a directory is atomic, so a reader sees
// either the old set of checkpoints or the new one, and a writer killed at any point leaves
// the previous checkpoints untouched. Old checkpoints are renamed to .trash-* before being
// deleted, so a half-deleted one never looks complete.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/files.h"
#include "dtrain/json.h"

namespace dtrain::checkpoint {

constexpr int kFormatVersion = 1;
constexpr const char* kManifestName = "MANIFEST";
constexpr uint64_t kMaxManifestBytes = 64 << 20;

std::string step_dir_name(int64_t step);  // "step_000000120"

// Complete checkpoints (step_N directories holding a MANIFEST) in `dir`, oldest first.
std::vector<std::pair<int64_t, std::string>> complete_checkpoints(const std::string& dir);
// The newest of them; "" when there is none (or `dir` does not exist).
std::string latest_complete(const std::string& dir);

// MANIFEST = "dtrain-checkpoint <version> crc32c=<8 hex digits>\n" + JSON + "\n"; the
// checksum covers the JSON text. Written with fsync.
void write_manifest(const std::string& checkpoint_path, const Json& manifest);
// Reads and checks it: CheckpointError "<path>/MANIFEST: <problem>" when it is missing,
// foreign (no dtrain header line), of another format version, or corrupted.
Json read_manifest(const std::string& checkpoint_path);

// Rank 0's steps of a save. prepare_temp removes leftovers of killed saves (.tmp-*,
// .trash-*) and creates an empty DIR/.tmp-step_N, returned. commit_temp fsyncs it, renames
// it to DIR/step_N (replacing an older checkpoint of the same step) and fsyncs DIR; returns
// the final path. prune keeps the newest `keep` complete checkpoints.
std::string temp_path(const std::string& dir, int64_t step);
std::string prepare_temp(const std::string& dir, int64_t step);
std::string commit_temp(const std::string& dir, int64_t step,
                        const std::function<void(const char*)>& on_progress = {});
void prune(const std::string& dir, int keep);

FileDigest digest_from_json(const Json& j);
Json digest_to_json(const FileDigest& d);

}  // namespace dtrain::checkpoint
