// What the two files of Sharded<Adam or Lamb> share (sharded.cc: making it
// and its step; sharded_state.cc: its state files): the name its errors
// give, and what differs between the two optimizers.
#pragma once

#include <string_view>

#include "gradkit/optim/sharded.h"

namespace gradkit::detail {

inline constexpr std::string_view kShardedOp = "Sharded";

// What differs between the sharded optimizers: the state file's kinds,
// the state sections split like the weights (in the order the unsharded
// optimizer writes them), the options, and the update.
template <class Optimizer> struct ShardedTraits;

template <>
struct ShardedTraits<Adam> {
  static constexpr std::string_view kind = "adam";
  static constexpr std::string_view mixed_kind = "mixed_precision_adam";
  static constexpr std::string_view sections[] = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
  static const AdamOptions& options(const ShardedOptions& o) { return o.adam; }
  // amsgrad's maxima: kept by every rank or by none (the groups decide).
  static bool keeps(const Adam& adam, std::string_view section) {
    return section != "max_exp_avg_sq" || !adam.max_exp_avg_sq().empty();
  }
};

template <>
struct ShardedTraits<Lamb> {
  static constexpr std::string_view kind = "lamb";
  static constexpr std::string_view mixed_kind = "mixed_precision_lamb";
  static constexpr std::string_view sections[] = {"exp_avg", "exp_avg_sq"};
  static const LambOptions& options(const ShardedOptions& o) { return o.lamb; }
  static bool keeps(const Lamb&, std::string_view) { return true; }
};

}  // namespace gradkit::detail
