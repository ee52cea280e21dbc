// What bench/torch_dist_bench.py measured, for the communication benchmarks
// to print beside their own rows: "<key> <ms>" per line.
#pragma once

#include <map>
#include <string>

namespace gradkit::tool {

// Empty when `path` is empty; when it cannot be read, says so on stderr
// (naming `program`) and returns nothing: the bench runs without the column.
std::map<std::string, double> read_torch_results(const std::string& path, const std::string& program);

}  // namespace gradkit::tool
