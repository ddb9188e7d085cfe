// Boost.Asio for io/net (internal). Boost 1.74's awaitable.hpp uses
// std::exchange without including <utility>, which C++20 libstdc++ no longer
// pulls in; including it first here keeps that out of every user.
#pragma once

// clang-format off
#include <utility>
#include <boost/asio.hpp>
// clang-format on
