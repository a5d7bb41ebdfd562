#include "tokenizer.h"

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>

#include <dtrain/errors.h>
#include <dtrain/json.h>

namespace gpt2 {
namespace {

struct CodePointRange {
  uint32_t first;
  uint32_t last;
};

// \p{L} and \p{N} as code point ranges, generated from Unicode 17.0 (node 20's ICU data):
//   for every code point c, /^\p{L}$/u.test(c) (resp. \p{N}), gathered into ranges;
//   neighbouring ranges separated only by unassigned code points (\p{Cn}) are merged.
// So every character assigned in Unicode 17.0 is classified exactly as Unicode (and
// JavaScript's and Python's regex engines, for the characters their Unicode versions
// know) classify it; only unassigned code points inside a merged gap count as letters or
// numbers, which no real text contains, and characters added after 17.0 count as "other".
// Regenerate with a newer node if that ever matters; the table is data, not logic.
constexpr CodePointRange kLetterRanges[] = {
    {0x41, 0x5a},       {0x61, 0x7a},       {0xaa, 0xaa},       {0xb5, 0xb5},
    {0xba, 0xba},       {0xc0, 0xd6},       {0xd8, 0xf6},       {0xf8, 0x2c1},
    {0x2c6, 0x2d1},     {0x2e0, 0x2e4},     {0x2ec, 0x2ec},     {0x2ee, 0x2ee},
    {0x370, 0x374},     {0x376, 0x37d},     {0x37f, 0x37f},     {0x386, 0x386},
    {0x388, 0x3f5},     {0x3f7, 0x481},     {0x48a, 0x559},     {0x560, 0x588},
    {0x5d0, 0x5f2},     {0x620, 0x64a},     {0x66e, 0x66f},     {0x671, 0x6d3},
    {0x6d5, 0x6d5},     {0x6e5, 0x6e6},     {0x6ee, 0x6ef},     {0x6fa, 0x6fc},
    {0x6ff, 0x6ff},     {0x710, 0x710},     {0x712, 0x72f},     {0x74d, 0x7a5},
    {0x7b1, 0x7b1},     {0x7ca, 0x7ea},     {0x7f4, 0x7f5},     {0x7fa, 0x7fa},
    {0x800, 0x815},     {0x81a, 0x81a},     {0x824, 0x824},     {0x828, 0x828},
    {0x840, 0x858},     {0x860, 0x887},     {0x889, 0x88f},     {0x8a0, 0x8c9},
    {0x904, 0x939},     {0x93d, 0x93d},     {0x950, 0x950},     {0x958, 0x961},
    {0x971, 0x980},     {0x985, 0x9b9},     {0x9bd, 0x9bd},     {0x9ce, 0x9ce},
    {0x9dc, 0x9e1},     {0x9f0, 0x9f1},     {0x9fc, 0x9fc},     {0xa05, 0xa39},
    {0xa59, 0xa5e},     {0xa72, 0xa74},     {0xa85, 0xab9},     {0xabd, 0xabd},
    {0xad0, 0xae1},     {0xaf9, 0xaf9},     {0xb05, 0xb39},     {0xb3d, 0xb3d},
    {0xb5c, 0xb61},     {0xb71, 0xb71},     {0xb83, 0xbb9},     {0xbd0, 0xbd0},
    {0xc05, 0xc39},     {0xc3d, 0xc3d},     {0xc58, 0xc61},     {0xc80, 0xc80},
    {0xc85, 0xcb9},     {0xcbd, 0xcbd},     {0xcdc, 0xce1},     {0xcf1, 0xcf2},
    {0xd04, 0xd3a},     {0xd3d, 0xd3d},     {0xd4e, 0xd4e},     {0xd54, 0xd56},
    {0xd5f, 0xd61},     {0xd7a, 0xd7f},     {0xd85, 0xdc6},     {0xe01, 0xe30},
    {0xe32, 0xe33},     {0xe40, 0xe46},     {0xe81, 0xeb0},     {0xeb2, 0xeb3},
    {0xebd, 0xec6},     {0xedc, 0xf00},     {0xf40, 0xf6c},     {0xf88, 0xf8c},
    {0x1000, 0x102a},   {0x103f, 0x103f},   {0x1050, 0x1055},   {0x105a, 0x105d},
    {0x1061, 0x1061},   {0x1065, 0x1066},   {0x106e, 0x1070},   {0x1075, 0x1081},
    {0x108e, 0x108e},   {0x10a0, 0x10fa},   {0x10fc, 0x135a},   {0x1380, 0x138f},
    {0x13a0, 0x13fd},   {0x1401, 0x166c},   {0x166f, 0x167f},   {0x1681, 0x169a},
    {0x16a0, 0x16ea},   {0x16f1, 0x1711},   {0x171f, 0x1731},   {0x1740, 0x1751},
    {0x1760, 0x1770},   {0x1780, 0x17b3},   {0x17d7, 0x17d7},   {0x17dc, 0x17dc},
    {0x1820, 0x1884},   {0x1887, 0x18a8},   {0x18aa, 0x191e},   {0x1950, 0x19c9},
    {0x1a00, 0x1a16},   {0x1a20, 0x1a54},   {0x1aa7, 0x1aa7},   {0x1b05, 0x1b33},
    {0x1b45, 0x1b4c},   {0x1b83, 0x1ba0},   {0x1bae, 0x1baf},   {0x1bba, 0x1be5},
    {0x1c00, 0x1c23},   {0x1c4d, 0x1c4f},   {0x1c5a, 0x1c7d},   {0x1c80, 0x1cbf},
    {0x1ce9, 0x1cec},   {0x1cee, 0x1cf3},   {0x1cf5, 0x1cf6},   {0x1cfa, 0x1dbf},
    {0x1e00, 0x1fbc},   {0x1fbe, 0x1fbe},   {0x1fc2, 0x1fcc},   {0x1fd0, 0x1fdb},
    {0x1fe0, 0x1fec},   {0x1ff2, 0x1ffc},   {0x2071, 0x2071},   {0x207f, 0x207f},
    {0x2090, 0x209c},   {0x2102, 0x2102},   {0x2107, 0x2107},   {0x210a, 0x2113},
    {0x2115, 0x2115},   {0x2119, 0x211d},   {0x2124, 0x2124},   {0x2126, 0x2126},
    {0x2128, 0x2128},   {0x212a, 0x212d},   {0x212f, 0x2139},   {0x213c, 0x213f},
    {0x2145, 0x2149},   {0x214e, 0x214e},   {0x2183, 0x2184},   {0x2c00, 0x2ce4},
    {0x2ceb, 0x2cee},   {0x2cf2, 0x2cf3},   {0x2d00, 0x2d6f},   {0x2d80, 0x2dde},
    {0x2e2f, 0x2e2f},   {0x3005, 0x3006},   {0x3031, 0x3035},   {0x303b, 0x303c},
    {0x3041, 0x3096},   {0x309d, 0x309f},   {0x30a1, 0x30fa},   {0x30fc, 0x318e},
    {0x31a0, 0x31bf},   {0x31f0, 0x31ff},   {0x3400, 0x4dbf},   {0x4e00, 0xa48c},
    {0xa4d0, 0xa4fd},   {0xa500, 0xa60c},   {0xa610, 0xa61f},   {0xa62a, 0xa66e},
    {0xa67f, 0xa69d},   {0xa6a0, 0xa6e5},   {0xa717, 0xa71f},   {0xa722, 0xa788},
    {0xa78b, 0xa801},   {0xa803, 0xa805},   {0xa807, 0xa80a},   {0xa80c, 0xa822},
    {0xa840, 0xa873},   {0xa882, 0xa8b3},   {0xa8f2, 0xa8f7},   {0xa8fb, 0xa8fb},
    {0xa8fd, 0xa8fe},   {0xa90a, 0xa925},   {0xa930, 0xa946},   {0xa960, 0xa97c},
    {0xa984, 0xa9b2},   {0xa9cf, 0xa9cf},   {0xa9e0, 0xa9e4},   {0xa9e6, 0xa9ef},
    {0xa9fa, 0xaa28},   {0xaa40, 0xaa42},   {0xaa44, 0xaa4b},   {0xaa60, 0xaa76},
    {0xaa7a, 0xaa7a},   {0xaa7e, 0xaaaf},   {0xaab1, 0xaab1},   {0xaab5, 0xaab6},
    {0xaab9, 0xaabd},   {0xaac0, 0xaac0},   {0xaac2, 0xaadd},   {0xaae0, 0xaaea},
    {0xaaf2, 0xaaf4},   {0xab01, 0xab5a},   {0xab5c, 0xab69},   {0xab70, 0xabe2},
    {0xac00, 0xd7fb},   {0xf900, 0xfb1d},   {0xfb1f, 0xfb28},   {0xfb2a, 0xfbb1},
    {0xfbd3, 0xfd3d},   {0xfd50, 0xfd8f},   {0xfd92, 0xfdc7},   {0xfdf0, 0xfdfb},
    {0xfe70, 0xfefc},   {0xff21, 0xff3a},   {0xff41, 0xff5a},   {0xff66, 0xffdc},
    {0x10000, 0x100fa}, {0x10280, 0x102d0}, {0x10300, 0x1031f}, {0x1032d, 0x10340},
    {0x10342, 0x10349}, {0x10350, 0x10375}, {0x10380, 0x1039d}, {0x103a0, 0x103cf},
    {0x10400, 0x1049d}, {0x104b0, 0x10563}, {0x10570, 0x10855}, {0x10860, 0x10876},
    {0x10880, 0x1089e}, {0x108e0, 0x108f5}, {0x10900, 0x10915}, {0x10920, 0x10939},
    {0x10940, 0x109b7}, {0x109be, 0x109bf}, {0x10a00, 0x10a00}, {0x10a10, 0x10a35},
    {0x10a60, 0x10a7c}, {0x10a80, 0x10a9c}, {0x10ac0, 0x10ac7}, {0x10ac9, 0x10ae4},
    {0x10b00, 0x10b35}, {0x10b40, 0x10b55}, {0x10b60, 0x10b72}, {0x10b80, 0x10b91},
    {0x10c00, 0x10cf2}, {0x10d00, 0x10d23}, {0x10d4a, 0x10d65}, {0x10d6f, 0x10d85},
    {0x10e80, 0x10ea9}, {0x10eb0, 0x10ec7}, {0x10f00, 0x10f1c}, {0x10f27, 0x10f45},
    {0x10f70, 0x10f81}, {0x10fb0, 0x10fc4}, {0x10fe0, 0x10ff6}, {0x11003, 0x11037},
    {0x11071, 0x11072}, {0x11075, 0x11075}, {0x11083, 0x110af}, {0x110d0, 0x110e8},
    {0x11103, 0x11126}, {0x11144, 0x11144}, {0x11147, 0x11172}, {0x11176, 0x11176},
    {0x11183, 0x111b2}, {0x111c1, 0x111c4}, {0x111da, 0x111da}, {0x111dc, 0x111dc},
    {0x11200, 0x1122b}, {0x1123f, 0x11240}, {0x11280, 0x112a8}, {0x112b0, 0x112de},
    {0x11305, 0x11339}, {0x1133d, 0x1133d}, {0x11350, 0x11350}, {0x1135d, 0x11361},
    {0x11380, 0x113b7}, {0x113d1, 0x113d1}, {0x113d3, 0x113d3}, {0x11400, 0x11434},
    {0x11447, 0x1144a}, {0x1145f, 0x114af}, {0x114c4, 0x114c5}, {0x114c7, 0x114c7},
    {0x11580, 0x115ae}, {0x115d8, 0x115db}, {0x11600, 0x1162f}, {0x11644, 0x11644},
    {0x11680, 0x116aa}, {0x116b8, 0x116b8}, {0x11700, 0x1171a}, {0x11740, 0x1182b},
    {0x118a0, 0x118df}, {0x118ff, 0x1192f}, {0x1193f, 0x1193f}, {0x11941, 0x11941},
    {0x119a0, 0x119d0}, {0x119e1, 0x119e1}, {0x119e3, 0x119e3}, {0x11a00, 0x11a00},
    {0x11a0b, 0x11a32}, {0x11a3a, 0x11a3a}, {0x11a50, 0x11a50}, {0x11a5c, 0x11a89},
    {0x11a9d, 0x11a9d}, {0x11ab0, 0x11af8}, {0x11bc0, 0x11be0}, {0x11c00, 0x11c2e},
    {0x11c40, 0x11c40}, {0x11c72, 0x11c8f}, {0x11d00, 0x11d30}, {0x11d46, 0x11d46},
    {0x11d60, 0x11d89}, {0x11d98, 0x11d98}, {0x11db0, 0x11ddb}, {0x11ee0, 0x11ef2},
    {0x11f02, 0x11f02}, {0x11f04, 0x11f33}, {0x11fb0, 0x11fb0}, {0x12000, 0x12399},
    {0x12480, 0x12ff0}, {0x13000, 0x1342f}, {0x13441, 0x13446}, {0x13460, 0x1611d},
    {0x16800, 0x16a5e}, {0x16a70, 0x16abe}, {0x16ad0, 0x16aed}, {0x16b00, 0x16b2f},
    {0x16b40, 0x16b43}, {0x16b63, 0x16d6c}, {0x16e40, 0x16e7f}, {0x16ea0, 0x16f4a},
    {0x16f50, 0x16f50}, {0x16f93, 0x16fe1}, {0x16fe3, 0x16fe3}, {0x16ff2, 0x16ff3},
    {0x17000, 0x1bc99}, {0x1d400, 0x1d6c0}, {0x1d6c2, 0x1d6da}, {0x1d6dc, 0x1d6fa},
    {0x1d6fc, 0x1d714}, {0x1d716, 0x1d734}, {0x1d736, 0x1d74e}, {0x1d750, 0x1d76e},
    {0x1d770, 0x1d788}, {0x1d78a, 0x1d7a8}, {0x1d7aa, 0x1d7c2}, {0x1d7c4, 0x1d7cb},
    {0x1df00, 0x1df2a}, {0x1e030, 0x1e06d}, {0x1e100, 0x1e12c}, {0x1e137, 0x1e13d},
    {0x1e14e, 0x1e14e}, {0x1e290, 0x1e2ad}, {0x1e2c0, 0x1e2eb}, {0x1e4d0, 0x1e4eb},
    {0x1e5d0, 0x1e5ed}, {0x1e5f0, 0x1e5f0}, {0x1e6c0, 0x1e6e2}, {0x1e6e4, 0x1e6e5},
    {0x1e6e7, 0x1e6ed}, {0x1e6f0, 0x1e6f4}, {0x1e6fe, 0x1e8c4}, {0x1e900, 0x1e943},
    {0x1e94b, 0x1e94b}, {0x1ee00, 0x1eebb}, {0x20000, 0x33479},
};
constexpr CodePointRange kNumberRanges[] = {
    {0x30, 0x39},       {0xb2, 0xb3},       {0xb9, 0xb9},       {0xbc, 0xbe},
    {0x660, 0x669},     {0x6f0, 0x6f9},     {0x7c0, 0x7c9},     {0x966, 0x96f},
    {0x9e6, 0x9ef},     {0x9f4, 0x9f9},     {0xa66, 0xa6f},     {0xae6, 0xaef},
    {0xb66, 0xb6f},     {0xb72, 0xb77},     {0xbe6, 0xbf2},     {0xc66, 0xc6f},
    {0xc78, 0xc7e},     {0xce6, 0xcef},     {0xd58, 0xd5e},     {0xd66, 0xd78},
    {0xde6, 0xdef},     {0xe50, 0xe59},     {0xed0, 0xed9},     {0xf20, 0xf33},
    {0x1040, 0x1049},   {0x1090, 0x1099},   {0x1369, 0x137c},   {0x16ee, 0x16f0},
    {0x17e0, 0x17f9},   {0x1810, 0x1819},   {0x1946, 0x194f},   {0x19d0, 0x19da},
    {0x1a80, 0x1a99},   {0x1b50, 0x1b59},   {0x1bb0, 0x1bb9},   {0x1c40, 0x1c49},
    {0x1c50, 0x1c59},   {0x2070, 0x2070},   {0x2074, 0x2079},   {0x2080, 0x2089},
    {0x2150, 0x2182},   {0x2185, 0x2189},   {0x2460, 0x249b},   {0x24ea, 0x24ff},
    {0x2776, 0x2793},   {0x2cfd, 0x2cfd},   {0x3007, 0x3007},   {0x3021, 0x3029},
    {0x3038, 0x303a},   {0x3192, 0x3195},   {0x3220, 0x3229},   {0x3248, 0x324f},
    {0x3251, 0x325f},   {0x3280, 0x3289},   {0x32b1, 0x32bf},   {0xa620, 0xa629},
    {0xa6e6, 0xa6ef},   {0xa830, 0xa835},   {0xa8d0, 0xa8d9},   {0xa900, 0xa909},
    {0xa9d0, 0xa9d9},   {0xa9f0, 0xa9f9},   {0xaa50, 0xaa59},   {0xabf0, 0xabf9},
    {0xff10, 0xff19},   {0x10107, 0x10133}, {0x10140, 0x10178}, {0x1018a, 0x1018b},
    {0x102e1, 0x102fb}, {0x10320, 0x10323}, {0x10341, 0x10341}, {0x1034a, 0x1034a},
    {0x103d1, 0x103d5}, {0x104a0, 0x104a9}, {0x10858, 0x1085f}, {0x10879, 0x1087f},
    {0x108a7, 0x108af}, {0x108fb, 0x108ff}, {0x10916, 0x1091b}, {0x109bc, 0x109bd},
    {0x109c0, 0x109ff}, {0x10a40, 0x10a48}, {0x10a7d, 0x10a7e}, {0x10a9d, 0x10a9f},
    {0x10aeb, 0x10aef}, {0x10b58, 0x10b5f}, {0x10b78, 0x10b7f}, {0x10ba9, 0x10baf},
    {0x10cfa, 0x10cff}, {0x10d30, 0x10d49}, {0x10e60, 0x10e7e}, {0x10f1d, 0x10f26},
    {0x10f51, 0x10f54}, {0x10fc5, 0x10fcb}, {0x11052, 0x1106f}, {0x110f0, 0x110f9},
    {0x11136, 0x1113f}, {0x111d0, 0x111d9}, {0x111e1, 0x111f4}, {0x112f0, 0x112f9},
    {0x11450, 0x11459}, {0x114d0, 0x114d9}, {0x11650, 0x11659}, {0x116c0, 0x116e3},
    {0x11730, 0x1173b}, {0x118e0, 0x118f2}, {0x11950, 0x11959}, {0x11bf0, 0x11bf9},
    {0x11c50, 0x11c6c}, {0x11d50, 0x11d59}, {0x11da0, 0x11da9}, {0x11de0, 0x11de9},
    {0x11f50, 0x11f59}, {0x11fc0, 0x11fd4}, {0x12400, 0x1246e}, {0x16130, 0x16139},
    {0x16a60, 0x16a69}, {0x16ac0, 0x16ac9}, {0x16b50, 0x16b61}, {0x16d70, 0x16d79},
    {0x16e80, 0x16e96}, {0x16ff4, 0x16ff6}, {0x1ccf0, 0x1ccf9}, {0x1d2c0, 0x1d2f3},
    {0x1d360, 0x1d378}, {0x1d7ce, 0x1d7ff}, {0x1e140, 0x1e149}, {0x1e2f0, 0x1e2f9},
    {0x1e4f0, 0x1e4f9}, {0x1e5f1, 0x1e5fa}, {0x1e8c7, 0x1e8cf}, {0x1e950, 0x1e959},
    {0x1ec71, 0x1ecab}, {0x1ecad, 0x1ecaf}, {0x1ecb1, 0x1ed2d}, {0x1ed2f, 0x1ed3d},
    {0x1f100, 0x1f10c}, {0x1fbf0, 0x1fbf9},
};

bool in_ranges(const CodePointRange* begin, const CodePointRange* end, uint32_t c) {
  const CodePointRange* it = std::upper_bound(
      begin, end, c, [](uint32_t v, const CodePointRange& r) { return v < r.first; });
  return it != begin && c <= (it - 1)->last;
}

// \s as Unicode's White_Space property, which Python's regex module and tiktoken use.
// JavaScript's \s differs in two code points (it adds U+FEFF and lacks U+0085).
bool is_space(uint32_t c) {
  return (c >= 0x09 && c <= 0x0d) || c == 0x20 || c == 0x85 || c == 0xa0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f || c == 0x205f ||
         c == 0x3000;
}

// Marks a byte that does not start a valid UTF-8 sequence; it is classified as "other"
// and consumed alone, so any byte string splits into pieces that cover it exactly.
constexpr uint32_t kInvalid = 0xffffffff;

struct CodePoint {
  uint32_t value;
  size_t length;
};

CodePoint decode_utf8(std::string_view s, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char b0 = byte(i);
  if (b0 < 0x80) return {b0, 1};
  size_t length;
  uint32_t value;
  uint32_t min;
  if ((b0 & 0xe0) == 0xc0) {
    length = 2, value = b0 & 0x1f, min = 0x80;
  } else if ((b0 & 0xf0) == 0xe0) {
    length = 3, value = b0 & 0x0f, min = 0x800;
  } else if ((b0 & 0xf8) == 0xf0) {
    length = 4, value = b0 & 0x07, min = 0x10000;
  } else {
    return {kInvalid, 1};
  }
  if (i + length > s.size()) return {kInvalid, 1};
  for (size_t k = 1; k < length; ++k) {
    const unsigned char b = byte(i + k);
    if ((b & 0xc0) != 0x80) return {kInvalid, 1};
    value = (value << 6) | (b & 0x3f);
  }
  // Overlong forms, surrogates and values past U+10FFFF are not characters.
  if (value < min || value > 0x10ffff || (value >= 0xd800 && value <= 0xdfff)) {
    return {kInvalid, 1};
  }
  return {value, length};
}

CharClass classify(uint32_t c) {
  if (c < 0x80) {
    if ((c | 0x20) >= 'a' && (c | 0x20) <= 'z') return CharClass::kLetter;
    if (c >= '0' && c <= '9') return CharClass::kNumber;
    return is_space(c) ? CharClass::kSpace : CharClass::kOther;
  }
  if (c == kInvalid) return CharClass::kOther;
  if (in_ranges(std::begin(kLetterRanges), std::end(kLetterRanges), c)) return CharClass::kLetter;
  if (in_ranges(std::begin(kNumberRanges), std::end(kNumberRanges), c)) return CharClass::kNumber;
  return is_space(c) ? CharClass::kSpace : CharClass::kOther;
}

// GPT-2's bytes_to_unicode(): printable Latin-1 bytes stand for themselves, the other 68
// bytes for U+0100.. in byte order, so every token string in encoder.json is printable.
std::array<uint32_t, 256> byte_to_unicode() {
  std::array<uint32_t, 256> table{};
  uint32_t next = 256;
  for (uint32_t b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) || b >= 0xae;
    table[b] = printable ? b : next++;
  }
  return table;
}

// A vocabulary file, at most kMaxVocabFileBytes (checked while reading too, for files whose
// size the file system does not know in advance).
std::string read_vocab_file(const std::filesystem::path& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) {
    throw dtrain::Error("GPT-2 vocabulary file " + path.string() +
                        " is missing (scripts/fetch-data.sh fetches encoder.json and vocab.bpe "
                        "into data/gpt2; the byte tokenizer needs no files)");
  }
  const auto too_large = [&] {
    return dtrain::Error(path.string() + ": larger than " + std::to_string(kMaxVocabFileBytes) +
                         " bytes, the limit for a vocabulary file");
  };
  if (const uintmax_t size = std::filesystem::file_size(path, ec);
      !ec && size > static_cast<uintmax_t>(kMaxVocabFileBytes)) {
    throw too_large();
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) throw dtrain::Error("cannot open " + path.string() + ": " + std::strerror(errno));
  std::string text;
  char buffer[1 << 16];
  while (in) {
    in.read(buffer, sizeof(buffer));
    text.append(buffer, static_cast<size_t>(in.gcount()));
    if (static_cast<int64_t>(text.size()) > kMaxVocabFileBytes) throw too_large();
  }
  if (in.bad()) throw dtrain::Error("cannot read " + path.string());
  return text;
}

// `text` for a message: at most 40 bytes, control and non-ASCII bytes as \xNN.
std::string printable(std::string_view text) {
  std::string out;
  for (size_t i = 0; i < text.size() && i < 40; ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      static const char kHex[] = "0123456789abcdef";
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    }
  }
  if (text.size() > 40) out += "...";
  return out;
}

// Calls emit(piece) for each of GPT-2's pre-tokenization pieces of `text`, in order.
template <typename Emit>
void for_each_piece(std::string_view text, Emit&& emit) {
  const size_t n = text.size();
  size_t pos = 0;
  while (pos < n) {
    const CodePoint c = decode_utf8(text, pos);
    // 's|'t|'re|'ve|'m|'ll|'d (ASCII, case-sensitive, tried first).
    if (c.value == '\'' && pos + 1 < n) {
      const char a = text[pos + 1];
      const char b = pos + 2 < n ? text[pos + 2] : '\0';
      size_t length = 0;
      if (a == 's' || a == 't' || a == 'm' || a == 'd') {
        length = 2;
      } else if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) {
        length = 3;
      }
      if (length > 0) {
        emit(text.substr(pos, length));
        pos += length;
        continue;
      }
    }
    // ` ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+`: an optional ASCII space, then a run of one class.
    size_t run = pos;
    CharClass cls = classify(c.value);
    if (c.value == ' ' && pos + 1 < n) {
      const CodePoint next = decode_utf8(text, pos + 1);
      const CharClass next_cls = classify(next.value);
      if (next_cls != CharClass::kSpace) {
        run = pos + 1;
        cls = next_cls;
      }
    }
    if (cls != CharClass::kSpace) {
      size_t end = run;
      while (end < n) {
        const CodePoint d = decode_utf8(text, end);
        if (classify(d.value) != cls) break;
        end += d.length;
      }
      emit(text.substr(pos, end - pos));
      pos = end;
      continue;
    }
    // `\s+(?!\S)|\s+`: a whitespace run, less its last character when a non-space follows
    // (that character then prefixes the next word), unless that would leave it empty.
    size_t end = pos;
    size_t last = pos;
    while (end < n) {
      const CodePoint d = decode_utf8(text, end);
      if (classify(d.value) != CharClass::kSpace) break;
      last = end;
      end += d.length;
    }
    if (end < n && last > pos) end = last;
    emit(text.substr(pos, end - pos));
    pos = end;
  }
}

}  // namespace

CharClass classify_code_point(uint32_t code_point) { return classify(code_point); }

std::vector<std::string_view> gpt2_split(std::string_view text) {
  std::vector<std::string_view> pieces;
  for_each_piece(text, [&](std::string_view piece) { pieces.push_back(piece); });
  return pieces;
}

std::vector<int32_t> encode_documents(const Tokenizer& tokenizer, std::string_view text) {
  if (tokenizer.eot() < 0) return tokenizer.encode(text);
  std::vector<int32_t> ids;
  size_t start = 0;
  while (true) {
    const size_t marker = text.find(kEndOfText, start);
    const std::vector<int32_t> part = tokenizer.encode(
        text.substr(start, marker == std::string_view::npos ? marker : marker - start));
    ids.insert(ids.end(), part.begin(), part.end());
    if (marker == std::string_view::npos) return ids;
    ids.push_back(tokenizer.eot());
    start = marker + kEndOfText.size();
  }
}

std::vector<int32_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> ids(text.size());
  std::transform(text.begin(), text.end(), ids.begin(),
                 [](char c) { return static_cast<int32_t>(static_cast<unsigned char>(c)); });
  return ids;
}

std::string ByteTokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string text(ids.size(), '\0');
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] > 255) {
      throw dtrain::InvalidArgument("ByteTokenizer::decode: id " + std::to_string(ids[i]) +
                                    " is outside [0, 256)");
    }
    text[i] = static_cast<char>(ids[i]);
  }
  return text;
}

Gpt2Tokenizer::Gpt2Tokenizer(const std::filesystem::path& encoder_json,
                             const std::filesystem::path& vocab_bpe) {
  const std::string json = read_vocab_file(encoder_json);
  const std::string bpe = read_vocab_file(vocab_bpe);
  load(json, bpe, encoder_json.string(), vocab_bpe.string());
}

std::unique_ptr<Gpt2Tokenizer> Gpt2Tokenizer::from_dir(const std::filesystem::path& dir) {
  return std::make_unique<Gpt2Tokenizer>(dir / "encoder.json", dir / "vocab.bpe");
}

std::unique_ptr<Gpt2Tokenizer> Gpt2Tokenizer::from_text(std::string_view encoder_json,
                                                        std::string_view vocab_bpe,
                                                        const std::string& encoder_name,
                                                        const std::string& bpe_name) {
  const auto fits = [](std::string_view text, const std::string& name) {
    if (static_cast<int64_t>(text.size()) > kMaxVocabFileBytes) {
      throw dtrain::Error(name + ": larger than " + std::to_string(kMaxVocabFileBytes) +
                          " bytes, the limit for a vocabulary file");
    }
  };
  fits(encoder_json, encoder_name);
  fits(vocab_bpe, bpe_name);
  std::unique_ptr<Gpt2Tokenizer> tokenizer(new Gpt2Tokenizer());
  tokenizer->load(encoder_json, vocab_bpe, encoder_name, bpe_name);
  return tokenizer;
}

void Gpt2Tokenizer::load(std::string_view json, std::string_view bpe, const std::string& source,
                         const std::string& bpe_source) {
  const std::array<uint32_t, 256> b2u = byte_to_unicode();
  std::unordered_map<uint32_t, unsigned char> u2b;
  for (uint32_t b = 0; b < 256; ++b) u2b[b2u[b]] = static_cast<unsigned char>(b);

  // Token strings are in the byte-to-unicode alphabet; the tokenizer works on raw bytes.
  const auto to_bytes = [&](std::string_view token, const std::string& where) {
    if (token.empty()) throw dtrain::Error(where + ": empty token");
    std::string bytes;
    for (size_t i = 0; i < token.size();) {
      const CodePoint c = decode_utf8(token, i);
      const auto it = u2b.find(c.value);
      if (it == u2b.end()) {
        throw dtrain::Error(where + ": token \"" + printable(token) +
                            "\" has a character outside GPT-2's byte alphabet");
      }
      bytes += static_cast<char>(it->second);
      i += c.length;
    }
    return bytes;
  };

  std::unordered_map<std::string, int32_t> ids;  // raw bytes -> id
  std::vector<bool> assigned;
  // encoder.json: one flat object of token strings to ids.
  dtrain::Json vocabulary;
  try {
    vocabulary = dtrain::Json::parse(json);
  } catch (const dtrain::JsonError& e) {
    throw dtrain::Error(source + ": malformed JSON: " + e.cause());
  }
  if (!vocabulary.is_object()) {
    throw dtrain::Error(source + ": malformed JSON: not an object of token strings to ids");
  }
  for (const auto& [key, value] : vocabulary.as_object()) {
    const std::string token = "token \"" + printable(key) + "\"";
    // A number may also come as a double (1e7, 3.0): bounded the same way.
    if (value.is_number() && value.as_double() >= static_cast<double>(kMaxVocabSize)) {
      throw dtrain::Error(source + ": id of " + token + " exceeds the maximum " +
                          std::to_string(kMaxVocabSize - 1));
    }
    if (value.is_number() && value.as_double() < 0) {
      throw dtrain::Error(source + ": negative id of " + token);
    }
    if (!value.is_int())
      throw dtrain::Error(source + ": the id of " + token + " is not an integer");
    // Bounded to [0, kMaxVocabSize) above, so these resizes are bounded too.
    const int64_t id = value.as_int();
    if (static_cast<size_t>(id) >= id_bytes_.size()) {
      id_bytes_.resize(id + 1);
      assigned.resize(id + 1);
    }
    if (assigned[id]) {
      throw dtrain::Error(source + ": id " + std::to_string(id) + " is given to two tokens");
    }
    // The reader refuses duplicate keys, and to_bytes is one to one: no token comes twice.
    std::string bytes = to_bytes(key, source);
    ids.emplace(bytes, static_cast<int32_t>(id));
    assigned[id] = true;
    id_bytes_[id] = std::move(bytes);
  }
  if (ids.size() != id_bytes_.size()) {
    throw dtrain::Error(source + ": ids are not 0.." + std::to_string(id_bytes_.size() - 1) +
                        " once each (" + std::to_string(ids.size()) + " distinct tokens)");
  }
  for (uint32_t b = 0; b < 256; ++b) {
    const auto it = ids.find(std::string(1, static_cast<char>(b)));
    if (it == ids.end()) throw dtrain::Error(source + ": no token for byte " + std::to_string(b));
    byte_ids_[b] = it->second;
  }
  if (const auto it = ids.find(std::string(kEndOfText)); it != ids.end()) eot_ = it->second;

  size_t line_start = 0;
  int64_t line_number = 0;
  int32_t rank = 0;
  while (line_start < bpe.size()) {
    size_t line_end = bpe.find('\n', line_start);
    if (line_end == std::string_view::npos) line_end = bpe.size();
    const std::string_view line = bpe.substr(line_start, line_end - line_start);
    line_start = line_end + 1;
    ++line_number;
    if (line.empty() || line.substr(0, 8) == "#version") continue;
    const std::string where = bpe_source + ":" + std::to_string(line_number);
    const size_t space = line.find(' ');
    if (space == std::string_view::npos) {
      throw dtrain::Error(where + ": bad merge line \"" + printable(line) + "\"");
    }
    const std::string left = to_bytes(line.substr(0, space), where);
    const std::string right = to_bytes(line.substr(space + 1), where);
    const auto l = ids.find(left);
    const auto r = ids.find(right);
    const auto merged = ids.find(left + right);
    if (l == ids.end() || r == ids.end() || merged == ids.end()) {
      throw dtrain::Error(where + ": merge \"" + printable(line) + "\" is not in " + source);
    }
    const uint64_t key = static_cast<uint64_t>(l->second) << 32 | static_cast<uint32_t>(r->second);
    merges_.emplace(key, Merge{rank++, merged->second});
  }
}

void Gpt2Tokenizer::encode_piece(std::string_view piece, std::vector<int32_t>& out) const {
  const std::string key(piece);
  if (const auto it = cache_.find(key); it != cache_.end()) {
    out.insert(out.end(), it->second.begin(), it->second.end());
    return;
  }
  std::vector<int32_t> word(piece.size());
  for (size_t i = 0; i < piece.size(); ++i)
    word[i] = byte_ids_[static_cast<unsigned char>(piece[i])];
  // encoder.py's bpe(): repeatedly merge every occurrence of the best-ranked adjacent pair.
  std::vector<int32_t> next;
  while (word.size() > 1) {
    Merge best{INT32_MAX, -1};
    uint64_t best_key = 0;
    for (size_t i = 0; i + 1 < word.size(); ++i) {
      const uint64_t key =
          static_cast<uint64_t>(word[i]) << 32 | static_cast<uint32_t>(word[i + 1]);
      const auto it = merges_.find(key);
      if (it != merges_.end() && it->second.rank < best.rank) {
        best = it->second;
        best_key = key;
      }
    }
    if (best.id < 0) break;
    const int32_t left = static_cast<int32_t>(best_key >> 32);
    const int32_t right = static_cast<int32_t>(best_key & 0xffffffff);
    next.clear();
    for (size_t i = 0; i < word.size(); ++i) {
      if (i + 1 < word.size() && word[i] == left && word[i + 1] == right) {
        next.push_back(best.id);
        ++i;
      } else {
        next.push_back(word[i]);
      }
    }
    word.swap(next);
  }
  out.insert(out.end(), word.begin(), word.end());
  // A bound on memory for adversarial inputs; real text has far fewer distinct pieces.
  if (cache_.size() >= (1u << 20)) cache_.clear();
  cache_.emplace(std::move(key), std::move(word));
}

std::vector<int32_t> Gpt2Tokenizer::encode(std::string_view text) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3);
  // One lock per call: the cache is the only mutable state, and per-piece locking would
  // cost more than it buys for the data pipeline's single caller.
  std::lock_guard<std::mutex> lock(cache_mutex_);
  for_each_piece(text, [&](std::string_view piece) { encode_piece(piece, ids); });
  return ids;
}

std::string Gpt2Tokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string text;
  for (const int32_t id : ids) {
    if (id < 0 || id >= static_cast<int32_t>(id_bytes_.size())) {
      throw dtrain::InvalidArgument("Gpt2Tokenizer::decode: id " + std::to_string(id) +
                                    " is outside [0, " + std::to_string(id_bytes_.size()) + ")");
    }
    text += id_bytes_[id];
  }
  return text;
}

bool has_gpt2_vocabulary(const std::filesystem::path& dir) {
  std::error_code ec;
  return std::filesystem::is_regular_file(dir / "encoder.json", ec) &&
         std::filesystem::is_regular_file(dir / "vocab.bpe", ec);
}

std::unique_ptr<Tokenizer> make_tokenizer(const std::string& name,
                                          const std::filesystem::path& vocab_dir) {
  if (name == "gpt2") return Gpt2Tokenizer::from_dir(vocab_dir);
  if (name == "byte") return std::make_unique<ByteTokenizer>();
  throw dtrain::InvalidArgument("unknown tokenizer \"" + name + "\" (expected gpt2 or byte)");
}

}  // namespace gpt2
