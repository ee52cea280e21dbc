#include "optim/hyperparameter_io.h"

#include <limits>

namespace gradkit {

std::string dtype_code_name(uint32_t code) {
  if (code == static_cast<uint32_t>(DType::u8)) return "u8 (8-bit moments)";
  if (code == kFourBitMomentCode) return "u4 (4-bit moments)";
  if (code == kLinearFourBitMomentCode) {
    return "u4 with the second moment on the linear map (format version 3's 4-bit moments, which this gradkit "
           "cannot read: its second moment's codes stand for other values)";
  }
  for (DType d : kAllDTypes) {
    if (code == static_cast<uint32_t>(d)) return std::string(dtype_name(d));
  }
  return "unknown dtype code " + std::to_string(code);
}

int64_t read_step_and_moment(SectionReader& meta, const std::string& path, DType moment) {
  return read_step_and_moment(meta, path, static_cast<uint32_t>(moment));
}

int64_t read_step_and_moment(SectionReader& meta, const std::string& path, uint32_t moment) {
  const auto step = meta.get<int64_t>();
  const auto code = meta.get<uint32_t>();
  if (step < 0 || step == std::numeric_limits<int64_t>::max()) {
    throw Error(ErrorCode::io_error, "state file '" + path + "' has step count " + std::to_string(step) +
                                         " in section 'meta', expected 0 to 2^63 - 2");
  }
  if (code != moment) {
    throw Error(ErrorCode::io_error, "state file '" + path + "' has moments of dtype " + dtype_code_name(code) +
                                         ", expected " + dtype_code_name(moment));
  }
  return step;
}

void write_hyperparameters(SectionWriter& out, const AdamHyperparameters& h) {
  out.put(h.lr).put(h.beta1).put(h.beta2).put(h.eps).put(h.weight_decay).put(static_cast<int32_t>(h.decay));
  out.put(static_cast<uint8_t>(h.bias_correction)).put(static_cast<uint8_t>(h.amsgrad)).put(static_cast<uint8_t>(h.maximize));
}

AdamHyperparameters read_hyperparameters(SectionReader& in, const AdamHyperparameters*) {
  AdamHyperparameters h;
  h.lr = in.get<float>();
  h.beta1 = in.get<float>();
  h.beta2 = in.get<float>();
  h.eps = in.get<float>();
  h.weight_decay = in.get<float>();
  h.decay = static_cast<WeightDecay>(in.get<int32_t>());
  h.bias_correction = in.get<uint8_t>() != 0;
  h.amsgrad = in.get<uint8_t>() != 0;
  h.maximize = in.get<uint8_t>() != 0;
  return h;
}

void write_hyperparameters(SectionWriter& out, const LambHyperparameters& h) {
  out.put(h.alpha).put(h.beta).put(h.lambda).put(h.epsilon).put(h.ratio_min).put(h.ratio_max).put(h.max_norm);
  out.put(static_cast<uint8_t>(h.bias_correction));
}

LambHyperparameters read_hyperparameters(SectionReader& in, const LambHyperparameters*) {
  LambHyperparameters h;
  h.alpha = in.get<float>();
  h.beta = in.get<float>();
  h.lambda = in.get<float>();
  h.epsilon = in.get<float>();
  h.ratio_min = in.get<float>();
  h.ratio_max = in.get<float>();
  h.max_norm = in.get<float>();
  h.bias_correction = in.get<uint8_t>() != 0;
  return h;
}

void write_hyperparameters(SectionWriter& out, const MuonHyperparameters& h) {
  out.put(h.lr).put(h.weight_decay).put(h.momentum).put(static_cast<uint8_t>(h.nesterov));
  const MuonNsCoefficients& k = h.ns_coefficients[0];
  out.put(k.a).put(k.b).put(k.c).put(h.eps).put(h.ns_steps).put(static_cast<int32_t>(h.adjust_lr));
}

MuonHyperparameters read_hyperparameters(SectionReader& in, const MuonHyperparameters*) {
  MuonHyperparameters h;
  h.lr = in.get<double>();
  h.weight_decay = in.get<double>();
  h.momentum = in.get<double>();
  h.nesterov = in.get<uint8_t>() != 0;
  h.ns_coefficients[0].a = in.get<float>();
  h.ns_coefficients[0].b = in.get<float>();
  h.ns_coefficients[0].c = in.get<float>();
  h.eps = in.get<float>();
  h.ns_steps = in.get<int32_t>();
  h.adjust_lr = static_cast<MuonLrAdjust>(in.get<int32_t>());
  return h;
}

void write_muon_recipe(SectionWriter& out, const MuonHyperparameters& h) {
  out.put(h.ns_coefficient_count);
  for (const MuonNsCoefficients& k : h.ns_coefficient_list()) out.put(k.a).put(k.b).put(k.c);
  out.put(static_cast<int32_t>(h.divisor)).put(static_cast<uint8_t>(h.equilibrate_rows));
  out.put(static_cast<uint8_t>(h.renormalize)).put(static_cast<uint8_t>(h.second_moment)).put(h.beta2);
  out.put(static_cast<uint8_t>(h.cautious_weight_decay));
}

void read_muon_recipe(SectionReader& in, MuonHyperparameters& h) {
  const auto count = in.get<int32_t>();
  if (count < 1 || count > kMuonMaxNsCoefficients) {
    throw Error(ErrorCode::io_error, "section 'recipe' has " + std::to_string(count) +
                                         " Newton-Schulz triples in a group, expected 1 to " +
                                         std::to_string(kMuonMaxNsCoefficients));
  }
  h.ns_coefficient_count = count;
  for (int32_t i = 0; i < count; ++i) {
    h.ns_coefficients[i].a = in.get<float>();
    h.ns_coefficients[i].b = in.get<float>();
    h.ns_coefficients[i].c = in.get<float>();
  }
  h.divisor = static_cast<MuonDivisor>(in.get<int32_t>());
  h.equilibrate_rows = in.get<uint8_t>() != 0;
  h.renormalize = in.get<uint8_t>() != 0;
  h.second_moment = in.get<uint8_t>() != 0;
  h.beta2 = in.get<double>();
  h.cautious_weight_decay = in.get<uint8_t>() != 0;
}

}  // namespace gradkit
