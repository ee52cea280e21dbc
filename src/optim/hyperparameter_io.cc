#include "optim/hyperparameter_io.h"

namespace gradkit {

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

}  // namespace gradkit
