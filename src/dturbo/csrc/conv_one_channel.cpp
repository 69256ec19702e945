// A direct convolution for layers with one input channel (a first layer on grey images), stride 1, dilation 1.
// oneDNN's cost for such a layer hardly depends on its output channels (docs/inference.md), so removing channels
// from it bought nothing; this kernel's cost follows them. Built on first use by dturbo.native.
//
// out[n, c, h, q] = b[c] + sum_{i, j} w[c, 0, i, j] * xpad[n, h + i, q + j]
//
// Optionally fused with what follows it: a leaky ReLU and a max-pooling (no padding), applied while the image's
// convolution is still in cache, so that the output written is the pooled one.
//
// Register blocking: 3 output channels x 4 vectors of 8 columns of one output row live in registers; every input
// vector is loaded once for the 3 channels. Images are split across the intra-op threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <cstring>
#include <vector>

namespace {

typedef float v8 __attribute__((vector_size(32)));  // GCC/Clang vector extension: AVX where built for it
constexpr int64_t kLanes = 8;
constexpr int64_t kVectors = 4;                      // vectors of one output row held at once (32 columns)
constexpr int64_t kCols = kLanes * kVectors;
constexpr int64_t kChannels = 3;                     // output channels a pass over the input rows

inline v8 load(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof(v));  // unaligned
  return v;
}

// max as torch's max-pooling takes it: a NaN wins (once m is NaN, std::max keeps it). Written so that the
// compiler emits a max instruction: a branch on v > m mispredicts half the time on real activations.
inline float nan_max(float m, float v) { return v != v ? v : std::max(m, v); }

// kCols columns of one output row for CB channels; img points at the first input row and column they need. With
// act, the leaky ReLU (x if x > 0 else slope * x, as torch's) is applied in registers.
template <int CB>
void row_block(const float* img, int64_t ld_img, int64_t k, const float* w, const float* b, bool act, float slope,
               float* out, int64_t ld_out) {
  v8 acc[CB][kVectors];
  for (int c = 0; c < CB; ++c)
    for (int r = 0; r < kVectors; ++r) acc[c][r] = v8{} + b[c];
  for (int64_t i = 0; i < k; ++i) {
    const float* src = img + i * ld_img;
    for (int64_t j = 0; j < k; ++j) {
      v8 v[kVectors];
      for (int r = 0; r < kVectors; ++r) v[r] = load(src + j + r * kLanes);
      for (int c = 0; c < CB; ++c) {
        const float wv = w[c * k * k + i * k + j];
        for (int r = 0; r < kVectors; ++r) acc[c][r] += wv * v[r];
      }
    }
  }
  if (act)
    for (int c = 0; c < CB; ++c)
      for (int r = 0; r < kVectors; ++r) acc[c][r] = acc[c][r] > 0.f ? acc[c][r] : acc[c][r] * slope;
  for (int c = 0; c < CB; ++c)
    for (int r = 0; r < kVectors; ++r) std::memcpy(out + c * ld_out + r * kLanes, &acc[c][r], sizeof(v8));
}

at::Tensor conv_one_channel(const at::Tensor& x_in, const at::Tensor& w_in, const at::Tensor& b_in, int64_t pad,
                            std::optional<double> slope, int64_t pool_k, int64_t pool_s) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kFloat && x_in.dim() == 4 && x_in.size(1) == 1,
              "conv_one_channel: x must be a float32 CPU tensor (N, 1, H, W), got ", x_in.sizes());
  TORCH_CHECK(w_in.scalar_type() == at::kFloat && w_in.dim() == 4 && w_in.size(1) == 1 &&
                  w_in.size(2) == w_in.size(3),
              "conv_one_channel: w must be float32 (C, 1, K, K), got ", w_in.sizes());
  TORCH_CHECK(b_in.scalar_type() == at::kFloat && b_in.dim() == 1 && b_in.size(0) == w_in.size(0),
              "conv_one_channel: b must be float32 (C,), got ", b_in.sizes());
  TORCH_CHECK(pad >= 0, "conv_one_channel: padding must be >= 0");
  TORCH_CHECK(pool_k >= 0 && (pool_k == 0 || pool_s >= 1), "conv_one_channel: pooling needs kernel >= 1, stride >= 1");
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous(), b = b_in.contiguous();
  const int64_t n_img = x.size(0), h_in = x.size(2), w_in_ = x.size(3), ch = w.size(0), k = w.size(2);
  const int64_t h_conv = h_in + 2 * pad - k + 1, w_conv = w_in_ + 2 * pad - k + 1;
  TORCH_CHECK(h_conv > 0 && w_conv > 0, "conv_one_channel: kernel larger than the padded input");
  // Max-pooling without padding (floor mode), as torch.nn.MaxPool2d(pool_k, pool_s).
  const int64_t h_out = pool_k ? (h_conv - pool_k) / pool_s + 1 : h_conv;
  const int64_t w_out = pool_k ? (w_conv - pool_k) / pool_s + 1 : w_conv;
  TORCH_CHECK(h_out > 0 && w_out > 0, "conv_one_channel: pooling window larger than the convolution's output");
  const int64_t blocks = (w_conv + kCols - 1) / kCols, w_round = blocks * kCols;
  const int64_t ld_img = w_round + k - 1, h_pad = h_in + 2 * pad;  // wide enough for the last block's loads
  const bool act = slope.has_value();
  const float neg = act ? static_cast<float>(*slope) : 1.f;
  at::Tensor out = at::empty({n_img, ch, h_out, w_out}, x.options());
  const float* xs = x.data_ptr<float>();
  const float* ws = w.data_ptr<float>();
  const float* bs = b.data_ptr<float>();
  float* os = out.data_ptr<float>();
  at::parallel_for(0, n_img, 8, [&](int64_t n0, int64_t n1) {
    std::vector<float> img(h_pad * ld_img, 0.f);            // the zero-padded image; its border stays zero
    std::vector<float> conv(ch * h_conv * w_round);          // one image's convolution (rows padded to blocks)
    std::vector<float> rows(w_round);                         // maxima over one pooling window's rows
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t h = 0; h < h_in; ++h)
        std::copy(xs + (n * h_in + h) * w_in_, xs + (n * h_in + h + 1) * w_in_, img.data() + (h + pad) * ld_img + pad);
      for (int64_t c0 = 0; c0 < ch; c0 += kChannels) {
        const int64_t cb = std::min(kChannels, ch - c0);
        const float* wc = ws + c0 * k * k;
        for (int64_t h = 0; h < h_conv; ++h) {
          for (int64_t blk = 0; blk < blocks; ++blk) {
            const float* src = img.data() + h * ld_img + blk * kCols;
            float* dst = conv.data() + (c0 * h_conv + h) * w_round + blk * kCols;
            const int64_t ld = h_conv * w_round;
            if (cb == 3) row_block<3>(src, ld_img, k, wc, bs + c0, act, neg, dst, ld);
            else if (cb == 2) row_block<2>(src, ld_img, k, wc, bs + c0, act, neg, dst, ld);
            else row_block<1>(src, ld_img, k, wc, bs + c0, act, neg, dst, ld);
          }
        }
      }
      // The pooling while the image's convolution is still in cache (the separate layers would each pass over it
      // in memory again): the maxima over the window's rows first (contiguous, vectorised), then along the row.
      for (int64_t c = 0; c < ch; ++c) {
        const float* cv = conv.data() + c * h_conv * w_round;
        float* o = os + (n * ch + c) * h_out * w_out;
        if (!pool_k) {
          for (int64_t h = 0; h < h_out; ++h) std::copy(cv + h * w_round, cv + h * w_round + w_out, o + h * w_out);
          continue;
        }
        for (int64_t ph = 0; ph < h_out; ++ph) {
          const float* first = cv + ph * pool_s * w_round;
          for (int64_t q = 0; q < w_round; q += kLanes) {
            v8 m = load(first + q);
            for (int64_t i = 1; i < pool_k; ++i) {
              const v8 v = load(first + i * w_round + q);
              m = (v > m) | (v != v) ? v : m;  // a NaN wins, as in torch's max-pooling
            }
            std::memcpy(rows.data() + q, &m, sizeof(v8));
          }
          for (int64_t pw = 0; pw < w_out; ++pw) {
            float m = rows[pw * pool_s];
            for (int64_t j = 1; j < pool_k; ++j) m = nan_max(m, rows[pw * pool_s + j]);
            o[ph * w_out + pw] = m;
          }
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(dturbo_kernels, m) {
  m.def("conv_one_channel(Tensor x, Tensor w, Tensor b, int pad, float? slope=None, int pool_k=0, int pool_s=1) "
        "-> Tensor");
}
TORCH_LIBRARY_IMPL(dturbo_kernels, CPU, m) { m.impl("conv_one_channel", conv_one_channel); }
