// libFuzzer target: gradkit train's IDX reader (tools/gradkit/train/idx_file.cc)
// on a data file from untrusted hands, as the images (3 dimensions) and as
// the labels (1 dimension) of Fashion-MNIST. The input is the file as it
// lies on disk: gzip'd (the seeds of Debian's dataset-fashion-mnist's form)
// or plain, which zlib reads as it is, so mutations reach the IDX header
// directly. Besides what the sanitizers report (and any exception other
// than gradkit::Error), the target stops on a refusal with another code than
// io_error and on an accepted file whose array does not hold exactly the
// bytes its dimensions announce.
//
// With GRADKIT_FUZZ_SEEDS=DIR it first writes valid files to DIR, plain and
// gzip'd: the seeds (scripts/fuzz).
#include <zlib.h>

#include <string>
#include <vector>

#include "fuzz_input.h"
#include "gradkit/core/error.h"
#include "train/idx_file.h"

namespace gradkit::fuzz {
namespace {

MemoryFile* input = nullptr;

// An IDX file of unsigned bytes: magic, big-endian dimensions, the values.
std::vector<uint8_t> idx_file(const std::vector<uint32_t>& dims) {
  std::vector<uint8_t> bytes = {0, 0, 0x08, static_cast<uint8_t>(dims.size())};
  size_t total = 1;
  for (uint32_t d : dims) {
    for (int shift : {24, 16, 8, 0}) bytes.push_back(static_cast<uint8_t>(d >> shift));
    total *= d;
  }
  for (size_t i = 0; i < total; ++i) bytes.push_back(static_cast<uint8_t>((i * 37) % 10));
  return bytes;
}

std::vector<uint8_t> gzip(const std::vector<uint8_t>& bytes) {
  uLongf size = compressBound(bytes.size()) + 32;
  std::vector<uint8_t> out(size);
  z_stream z{};
  deflateInit2(&z, Z_BEST_COMPRESSION, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY);  // 15 + 16: a gzip wrapper
  z.next_in = const_cast<uint8_t*>(bytes.data());
  z.avail_in = static_cast<uInt>(bytes.size());
  z.next_out = out.data();
  z.avail_out = static_cast<uInt>(out.size());
  deflate(&z, Z_FINISH);
  out.resize(z.total_out);
  deflateEnd(&z);
  return out;
}

void write_seeds(const std::string& dir) {
  const std::vector<uint8_t> labels = idx_file({10}), images = idx_file({2, 28, 28});
  write_file(dir + "/labels", labels);
  write_file(dir + "/labels.gz", gzip(labels));
  write_file(dir + "/images", images);
  write_file(dir + "/images.gz", gzip(images));
}

void read_as(int rank) {
  try {
    const train::IdxArray a = train::read_idx(input->path(), rank);
    size_t total = 1;
    for (int64_t d : a.dims) total *= static_cast<size_t>(d);
    if (static_cast<int>(a.dims.size()) != rank || a.data.size() != total) {
      finding("read_idx accepted a file whose array does not match its " + std::to_string(a.dims.size()) +
              " dimensions");
    }
  } catch (const Error& e) {
    if (e.code() != ErrorCode::io_error) finding(std::string("read_idx refused a file with ") + e.what());
  }
}

}  // namespace
}  // namespace gradkit::fuzz

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  gradkit::fuzz::input = new gradkit::fuzz::MemoryFile;
  const std::string seeds = gradkit::fuzz::seed_directory();
  if (!seeds.empty()) gradkit::fuzz::write_seeds(seeds);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  gradkit::fuzz::input->write(data, size);
  gradkit::fuzz::read_as(3);
  gradkit::fuzz::read_as(1);
  return 0;
}
