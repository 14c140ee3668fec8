// Writing a config back out: to_yaml, the atomic config.yaml of a run, the
// markdown reference, and equality. All driven by the schema.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <stdexcept>

#include "framework/config/config.h"
#include "framework/config/schema.h"

namespace framework::config {
namespace {

std::vector<std::string> split_path(const std::string& path) {
  std::vector<std::string> parts;
  size_t start = 0;
  for (size_t dot = path.find('.'); dot != std::string::npos; dot = path.find('.', start)) {
    parts.push_back(path.substr(start, dot - start));
    start = dot + 1;
  }
  parts.push_back(path.substr(start));
  return parts;
}

std::string escape_markdown_cell(const std::string& text) {
  std::string out;
  for (char ch : text) {
    if (ch == '|') out += '\\';
    out += ch;
  }
  return out;
}

// "an integer >= 1" -> "integer >= 1": the type column has no article.
std::string type_column(const Key& key) {
  std::string text = describe_expected(key);
  for (const char* article : {"an ", "a "})
    if (text.rfind(article, 0) == 0) return text.substr(std::strlen(article));
  return text;
}

[[noreturn]] void fail_io(const std::string& what, const std::string& path, int err) {
  throw std::runtime_error(what + " " + path + ": " + std::strerror(err));
}

void write_all(int fd, const std::string& text, const std::string& path) {
  size_t done = 0;
  while (done < text.size()) {
    ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail_io("cannot write", path, errno);
    done += static_cast<size_t>(n);
  }
}

}  // namespace

bool operator==(const Config& a, const Config& b) {
  for (const Key& key : schema())
    if (key.get(a) != key.get(b)) return false;
  return true;
}

bool operator!=(const Config& a, const Config& b) { return !(a == b); }

std::vector<KeyChange> changed_keys(const Config& was, const Config& now,
                                    const std::vector<std::string>& prefixes) {
  std::vector<KeyChange> changes;
  for (const Key& key : schema()) {
    const std::string path = key.path;
    bool wanted = false;
    for (const std::string& p : prefixes) wanted = wanted || path == p || path.rfind(p, 0) == 0;
    if (!wanted || key.get(was) == key.get(now)) continue;
    changes.push_back({path, format_key_value(key, key.get(was)), format_key_value(key, key.get(now))});
  }
  return changes;
}

std::string to_yaml(const Config& cfg) {
  std::string out = "# Effective configuration: defaults, then the config file, then --set.\n";
  std::vector<std::string> open;  // the sections we are inside, outermost first
  for (const Key& key : schema()) {
    std::vector<std::string> parts = split_path(key.path);
    std::vector<std::string> section(parts.begin(), parts.end() - 1);
    size_t common = 0;
    while (common < open.size() && common < section.size() && open[common] == section[common])
      ++common;
    if (common == 0 && !open.empty()) out += "\n";
    for (size_t i = common; i < section.size(); ++i)
      out += std::string(2 * i, ' ') + section[i] + ":\n";
    open = section;
    out += std::string(2 * section.size(), ' ') + parts.back() + ": " +
           format_key_value(key, key.get(cfg)) + "\n";
  }
  return out;
}

void write_effective_config(const Config& cfg, const std::string& run_dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(run_dir, ec);
  if (ec) fail_io("cannot create run directory", run_dir, ec.value());
  std::string final_path = (fs::path(run_dir) / "config.yaml").string();
  std::string tmp_path = final_path + ".tmp." + std::to_string(::getpid());
  int fd = ::open(tmp_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail_io("cannot create", tmp_path, errno);
  try {
    write_all(fd, to_yaml(cfg), tmp_path);
    if (::fsync(fd) != 0) fail_io("cannot fsync", tmp_path, errno);
  } catch (...) {
    ::close(fd);
    ::unlink(tmp_path.c_str());
    throw;
  }
  if (::close(fd) != 0) {
    int err = errno;
    ::unlink(tmp_path.c_str());
    fail_io("cannot close", tmp_path, err);
  }
  if (::rename(tmp_path.c_str(), final_path.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp_path.c_str());
    fail_io("cannot rename " + tmp_path + " to", final_path, err);
  }
}

std::string reference_markdown() {
  const Config defaults;
  std::string out = "| key | type | default | meaning |\n|---|---|---|---|\n";
  for (const Key& key : schema()) {
    out += "| `" + std::string(key.path) + "` | " + escape_markdown_cell(type_column(key)) +
           " | `" + escape_markdown_cell(format_key_value(key, key.get(defaults))) + "` | " + escape_markdown_cell(key.doc) +
           " |\n";
  }
  return out;
}

}  // namespace framework::config
