// Checks usable inside rank threads: they throw, so a failing rank stops and its peers
// time out instead of hanging (a gtest ASSERT would only return from the lambda).
#pragma once

#include <stdexcept>
#include <string>

#include <fmt/format.h>
#include <fmt/ranges.h>

#define DTRAIN_CHECK(cond, ...)                                                               \
  do {                                                                                        \
    if (!(cond)) {                                                                            \
      throw std::runtime_error(fmt::format("{}:{}: check failed: {}: {}", __FILE__, __LINE__, \
                                           #cond, fmt::format(__VA_ARGS__)));                 \
    }                                                                                         \
  } while (0)
