#include "dtrain_cli/flags.h"

#include <absl/flags/commandlineflag.h>
#include <absl/flags/reflection.h>

#include <algorithm>
#include <stdexcept>
#include <string_view>
#include <tuple>

namespace dtrain::cli {

size_t parse_flags(const std::vector<std::string>& args, size_t first, Positional positional) {
  size_t i = first;
  for (; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "--") return i + 1;
    if (arg.rfind("--", 0) != 0) {
      if (positional == Positional::kStop) return i;
      throw std::invalid_argument("unexpected argument '" + arg + "'");
    }
    const size_t eq = arg.find('=');
    const std::string name = arg.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    if (flag == nullptr || flag->IsRetired()) {
      throw std::invalid_argument("unknown option --" + name);
    }
    std::string value;
    if (eq != std::string::npos) {
      value = arg.substr(eq + 1);
    } else if (flag->IsOfType<bool>()) {
      value = "true";
    } else if (i + 1 < args.size()) {
      value = args[++i];
    } else {
      throw std::invalid_argument("--" + name + " needs a value");
    }
    std::string error;
    if (!flag->ParseFrom(value, &error)) throw std::invalid_argument(error);
  }
  return i;
}

namespace {

// `text` as lines of at most `width` characters (longer words stay whole), each after `indent`.
std::string wrap(const std::string& text, size_t indent, size_t width) {
  std::string out, line;
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t end = std::min(text.find(' ', pos), text.size());
    const std::string word = text.substr(pos, end - pos);
    pos = end + 1;
    if (!line.empty() && line.size() + 1 + word.size() > width) {
      out += std::string(indent, ' ') + line + "\n";
      line.clear();
    }
    line += (line.empty() ? "" : " ") + word;
  }
  if (!line.empty()) out += std::string(indent, ' ') + line + "\n";
  return out;
}

}  // namespace

std::string flags_help() {
  std::vector<const absl::CommandLineFlag*> flags;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (!flag->IsRetired()) flags.push_back(flag);
  }
  auto file_of = [](const absl::CommandLineFlag* f) {
    const std::string path = f->Filename();
    return path.substr(path.find_last_of('/') + 1);
  };
  std::sort(flags.begin(), flags.end(), [&](const auto* a, const auto* b) {
    return std::make_tuple(file_of(a), a->Name()) < std::make_tuple(file_of(b), b->Name());
  });
  std::string text, file;
  for (const auto* f : flags) {
    if (file_of(f) != file) {
      file = file_of(f);
      text += (text.empty() ? "" : "\n") + std::string("flags of ") + file + ":\n";
    }
    const std::string value = f->IsOfType<bool>() ? "" : "=<value>";
    const std::string def = f->DefaultValue();
    text += "  --" + std::string(f->Name()) + value + "  (default " +
            (def.empty() ? std::string("\"\"") : def) + ")\n" + wrap(f->Help(), 6, 84);
  }
  return text;
}

}  // namespace dtrain::cli
