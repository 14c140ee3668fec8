#include "checkpoint/storage/memory.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <map>
#include <mutex>
#include <vector>

namespace checkpoint {

namespace {

struct Node {
  bool directory = false;
  std::shared_ptr<std::vector<uint8_t>> bytes;  // files only; shared with open writers
  int64_t mtime_unix_s = 0;
};

std::string trim_slash(std::string path) {
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  return path;
}

bool is_root(const std::string& path) { return path == "/" || path == "." || path.empty(); }

bool is_under(const std::string& path, const std::string& dir) {
  return path.size() > dir.size() && path.compare(0, dir.size(), dir) == 0 && path[dir.size()] == '/';
}

class MemoryFile final : public WritableFile {
 public:
  MemoryFile(std::shared_ptr<std::mutex> mu, std::shared_ptr<std::vector<uint8_t>> bytes,
             std::string path)
      : mu_(std::move(mu)), bytes_(std::move(bytes)), path_(std::move(path)) {}

  void append(const void* data, size_t n) override {
    write_at(position_, data, n);
    position_ += n;
  }
  void write_at(uint64_t offset, const void* data, size_t n) override {
    if (closed_) throw IoError("cannot write " + path_ + ": the file is closed", EBADF);
    std::lock_guard<std::mutex> lock(*mu_);
    if (bytes_->size() < offset + n) bytes_->resize(offset + n);
    if (n > 0) std::memcpy(bytes_->data() + offset, data, n);
  }
  void sync() override {
    if (closed_) throw IoError("cannot fsync " + path_ + ": the file is closed", EBADF);
  }
  void close() override { closed_ = true; }

 private:
  std::shared_ptr<std::mutex> mu_;
  std::shared_ptr<std::vector<uint8_t>> bytes_;
  std::string path_;
  uint64_t position_ = 0;
  bool closed_ = false;
};

class MemoryStorage final : public Storage {
 public:
  std::unique_ptr<WritableFile> create_file(const std::string& raw) override {
    const std::string path = trim_slash(raw);
    std::lock_guard<std::mutex> lock(*mu_);
    require_parent(path, "cannot create");
    auto it = nodes_.find(path);
    if (it != nodes_.end() && it->second.directory) {
      throw IoError::from_errno("cannot create", path, EISDIR);
    }
    Node node;
    node.bytes = std::make_shared<std::vector<uint8_t>>();
    node.mtime_unix_s = now();
    nodes_[path] = node;  // truncates: a writer of the old file keeps the old bytes
    return std::make_unique<MemoryFile>(mu_, node.bytes, path);
  }

  void read_at(const std::string& raw, uint64_t offset, void* dst, size_t n) override {
    const std::string path = trim_slash(raw);
    std::lock_guard<std::mutex> lock(*mu_);
    const Node& node = file(path, "cannot read");
    if (offset + n > node.bytes->size()) {
      throw IoError("truncated: " + path + " has " + std::to_string(node.bytes->size()) +
                    " bytes, needed " + std::to_string(offset + n));
    }
    if (n > 0) std::memcpy(dst, node.bytes->data() + offset, n);
  }

  uint64_t file_size(const std::string& raw) override {
    const std::string path = trim_slash(raw);
    std::lock_guard<std::mutex> lock(*mu_);
    return file(path, "cannot stat").bytes->size();
  }

  FileInfo stat(const std::string& raw) override {
    const std::string path = trim_slash(raw);
    std::lock_guard<std::mutex> lock(*mu_);
    FileInfo info;
    if (is_root(path)) {
      info.type = FileType::kDirectory;
      return info;
    }
    auto it = nodes_.find(path);
    if (it == nodes_.end()) return info;
    info.type = it->second.directory ? FileType::kDirectory : FileType::kFile;
    info.size = it->second.directory ? 0 : it->second.bytes->size();
    info.mtime_unix_s = it->second.mtime_unix_s;
    return info;
  }

  void make_dirs(const std::string& raw) override {
    const std::string path = trim_slash(raw);
    std::lock_guard<std::mutex> lock(*mu_);
    for (size_t pos = path.find('/', 1);; pos = path.find('/', pos + 1)) {
      const std::string prefix = path.substr(0, pos);
      auto it = nodes_.find(prefix);
      if (it == nodes_.end()) {
        Node dir;
        dir.directory = true;
        dir.mtime_unix_s = now();
        nodes_[prefix] = dir;
      } else if (!it->second.directory) {
        throw IoError("cannot create directory " + path + ": a file is in the way", ENOTDIR);
      }
      if (pos == std::string::npos) break;
    }
  }

  void rename(const std::string& raw_from, const std::string& raw_to) override {
    const std::string from = trim_slash(raw_from), to = trim_slash(raw_to);
    std::lock_guard<std::mutex> lock(*mu_);
    auto src = nodes_.find(from);
    if (src == nodes_.end()) throw IoError::from_errno("cannot rename " + from + " to", to, ENOENT);
    require_parent(to, "cannot rename " + from + " to");
    if (from == to) return;
    auto dst = nodes_.find(to);
    if (dst != nodes_.end()) {
      if (dst->second.directory != src->second.directory) {
        throw IoError::from_errno("cannot rename " + from + " to", to,
                                  dst->second.directory ? EISDIR : ENOTDIR);
      }
      if (dst->second.directory && has_children(to)) {
        throw IoError::from_errno("cannot rename " + from + " to", to, ENOTEMPTY);
      }
    }
    std::map<std::string, Node> moved;
    for (auto it = nodes_.begin(); it != nodes_.end();) {
      if (it->first == from || is_under(it->first, from)) {
        moved[to + it->first.substr(from.size())] = it->second;
        it = nodes_.erase(it);
      } else {
        ++it;
      }
    }
    for (auto& [path, node] : moved) nodes_[path] = node;
  }

  void sync_dir(const std::string& raw) override {
    const std::string path = trim_slash(raw);
    std::lock_guard<std::mutex> lock(*mu_);
    if (is_root(path)) return;
    auto it = nodes_.find(path);
    if (it == nodes_.end() || !it->second.directory) {
      throw IoError::from_errno("cannot open directory", path, it == nodes_.end() ? ENOENT : ENOTDIR);
    }
  }

  std::vector<std::string> list_dir(const std::string& raw) override {
    const std::string path = trim_slash(raw);
    std::lock_guard<std::mutex> lock(*mu_);
    if (!is_root(path)) {
      auto it = nodes_.find(path);
      if (it == nodes_.end()) throw IoError::from_errno("cannot list", path, ENOENT);
      if (!it->second.directory) throw IoError::from_errno("cannot list", path, ENOTDIR);
    }
    std::vector<std::string> names;
    for (const auto& [p, node] : nodes_) {
      const std::string rest = child_part(p, path);
      if (!rest.empty() && rest.find('/') == std::string::npos) names.push_back(rest);
    }
    std::sort(names.begin(), names.end());
    return names;
  }

  void remove_all(const std::string& raw) override {
    const std::string path = trim_slash(raw);
    std::lock_guard<std::mutex> lock(*mu_);
    for (auto it = nodes_.begin(); it != nodes_.end();) {
      if (it->first == path || is_under(it->first, path)) {
        it = nodes_.erase(it);
      } else {
        ++it;
      }
    }
  }

 private:
  static int64_t now() { return static_cast<int64_t>(std::time(nullptr)); }

  // What follows "<dir>/" in `path`, or "" when `path` is not under `dir`.
  static std::string child_part(const std::string& path, const std::string& dir) {
    if (is_root(dir)) {
      if (dir == "/") return path.size() > 1 && path[0] == '/' ? path.substr(1) : "";
      return path.empty() || path[0] == '/' ? "" : path;
    }
    return is_under(path, dir) ? path.substr(dir.size() + 1) : "";
  }

  bool has_children(const std::string& dir) const {
    for (const auto& entry : nodes_) {
      if (is_under(entry.first, dir)) return true;
    }
    return false;
  }

  void require_parent(const std::string& path, const std::string& what) const {
    const std::string parent = parent_dir(path);
    if (is_root(parent)) return;
    auto it = nodes_.find(parent);
    if (it == nodes_.end()) throw IoError::from_errno(what, path, ENOENT);
    if (!it->second.directory) throw IoError::from_errno(what, path, ENOTDIR);
  }

  const Node& file(const std::string& path, const std::string& what) const {
    auto it = nodes_.find(path);
    if (it == nodes_.end()) throw IoError::from_errno(what, path, ENOENT);
    if (it->second.directory) throw IoError::from_errno(what, path, EISDIR);
    return it->second;
  }

  std::shared_ptr<std::mutex> mu_ = std::make_shared<std::mutex>();
  std::map<std::string, Node> nodes_;
};

}  // namespace

std::shared_ptr<Storage> memory_storage() { return std::make_shared<MemoryStorage>(); }

}  // namespace checkpoint
