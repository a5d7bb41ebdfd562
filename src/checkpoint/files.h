// File primitives of the checkpoint format: a writer that checksums what it writes (CRC-32C
// per 1 MiB chunk) and fsyncs, and readers that read byte ranges, optionally verifying the
// chunks they touch against the recorded checksums (so a rank that reads a part of a file
// reads and verifies only the chunks it needs).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace dtrain::checkpoint {

constexpr uint64_t kChunkBytes = uint64_t{1} << 20;

// Size and per-chunk CRC-32C of a file: chunk k covers [k * chunk_bytes, (k+1) * chunk_bytes).
struct FileDigest {
  uint64_t size = 0;
  uint64_t chunk_bytes = kChunkBytes;
  std::vector<uint32_t> chunk_crcs;
};

// Creates (truncates) `path` and appends to it; finish() fsyncs, closes and returns the
// digest. Errors throw CheckpointError naming the path and errno's text.
class FileWriter {
 public:
  explicit FileWriter(std::string path);
  ~FileWriter();
  FileWriter(const FileWriter&) = delete;
  FileWriter& operator=(const FileWriter&) = delete;

  void write(const void* data, size_t n);
  FileDigest finish();
  uint64_t bytes_written() const { return digest_.size; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
  FileDigest digest_;
  uint32_t chunk_crc_ = 0;   // running CRC of the current, incomplete chunk
  uint64_t chunk_fill_ = 0;  // bytes in it
};

// Byte ranges of one file. read() throws CheckpointError "<path>: <problem>".
class ByteSource {
 public:
  virtual ~ByteSource() = default;
  virtual uint64_t size() const = 0;
  virtual void read(uint64_t offset, void* out, size_t n) = 0;
  virtual const std::string& path() const = 0;
  // Bytes actually read from disk so far (verification reads whole chunks).
  virtual uint64_t bytes_read() const = 0;
  // The file's bytes when it is memory-mapped; null otherwise.
  virtual const uint8_t* mapped() const { return nullptr; }
  // Drops the mapped pages of [offset, offset + n) from this process's resident set (the
  // page cache keeps them; a later read faults them back). No-op for a source that reads.
  virtual void release(uint64_t /*offset*/, uint64_t /*n*/) {}
};

// A file mapped read-only, no checksums (safetensors files from elsewhere): a read copies
// exactly the requested bytes out of the mapping, so it touches no other page of the file.
class MappedFile final : public ByteSource {
 public:
  explicit MappedFile(std::string path);
  ~MappedFile() override;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  uint64_t size() const override { return size_; }
  void read(uint64_t offset, void* out, size_t n) override;
  const std::string& path() const override { return path_; }
  uint64_t bytes_read() const override { return bytes_read_; }
  const uint8_t* mapped() const override { return data_; }
  void release(uint64_t offset, uint64_t n) override;

 private:
  std::string path_;
  const uint8_t* data_ = nullptr;  // null for an empty file (nothing to map)
  uint64_t size_ = 0;
  uint64_t bytes_read_ = 0;
};

// A file whose size and chunk checksums are known (from a manifest): a size mismatch is
// refused at open ("truncated" / "longer than recorded"), and every chunk a read touches
// is verified once ("checksum mismatch in bytes [a, b)").
class VerifiedFile final : public ByteSource {
 public:
  VerifiedFile(std::string path, FileDigest expected);
  ~VerifiedFile() override;
  uint64_t size() const override { return expected_.size; }
  void read(uint64_t offset, void* out, size_t n) override;
  const std::string& path() const override { return path_; }
  uint64_t bytes_read() const override { return bytes_read_; }

 private:
  std::string path_;
  int fd_ = -1;
  FileDigest expected_;
  std::vector<bool> verified_;
  // The chunk verified last: tensors are read in file order, so the next read usually
  // starts inside it, and its bytes are not read from the file a second time.
  std::vector<uint8_t> last_chunk_;
  uint64_t last_chunk_index_ = UINT64_MAX;
  uint64_t bytes_read_ = 0;
};

// Reads [offset, offset + n) of fd into out; throws CheckpointError on a short read.
void read_exact(int fd, const std::string& path, uint64_t offset, void* out, size_t n);
// Whole small file into a string (manifests, sidecars).
std::string read_small_file(const std::string& path, uint64_t limit);
// Writes `text` to `path` with fsync.
FileDigest write_small_file(const std::string& path, const std::string& text);
// fsync of a directory, so that entries created or renamed in it are durable.
void fsync_directory(const std::string& path);

}  // namespace dtrain::checkpoint
