#include "checkpoint/storage/storage.h"

#include <cstring>

namespace checkpoint {

IoError IoError::from_errno(const std::string& what, const std::string& path, int error_number) {
  return IoError(what + " " + path + ": " + std::strerror(error_number), error_number);
}

WritableFile::~WritableFile() = default;
Storage::~Storage() = default;

void Storage::write_file_atomic(const std::string& path, const std::vector<uint8_t>& bytes) {
  const std::string tmp = path + ".tmp";
  std::unique_ptr<WritableFile> file = create_file(tmp);
  file->append(bytes.data(), bytes.size());
  file->sync();
  file->close();
  rename(tmp, path);
  sync_dir(parent_dir(path));
}

void Storage::make_dirs_durable(const std::string& raw) {
  std::string path = raw;
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  std::vector<std::string> created;  // deepest first
  for (std::string p = path; !p.empty() && p != "." && p != "/"; p = parent_dir(p)) {
    if (stat(p).type != FileType::kMissing) break;
    created.push_back(p);
  }
  make_dirs(path);
  for (auto it = created.rbegin(); it != created.rend(); ++it) sync_dir(parent_dir(*it));
}

std::vector<uint8_t> Storage::read_file(const std::string& path, uint64_t max_bytes) {
  const uint64_t size = file_size(path);
  if (size > max_bytes) {
    throw IoError(path + ": " + std::to_string(size) + " bytes is more than the " +
                  std::to_string(max_bytes) + " allowed");
  }
  std::vector<uint8_t> bytes(static_cast<size_t>(size));
  read_at(path, 0, bytes.data(), bytes.size());
  return bytes;
}

std::string join_path(const std::string& dir, const std::string& name) {
  if (dir.empty()) return name;
  if (dir.back() == '/') return dir + name;
  return dir + "/" + name;
}

std::string parent_dir(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

}  // namespace checkpoint
