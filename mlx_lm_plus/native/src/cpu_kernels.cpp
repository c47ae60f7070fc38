// mlx_lm_plus's CPU kernels, an MLX extension (see ../__init__.py for why).
//
// quantized_matvec(x, w, scales, biases, group_size, bits):
//   x @ dequantize(w, scales, biases).T for a few rows of x (decode steps),
//   with MLX's affine quantization (mx.quantize's layout: `bits`-bit values
//   packed low bits first in uint32s along K, a scale and a bias per
//   `group_size` values). The weights are read once for all rows, as packed
//   bytes: the point (decode on a CPU is bound by the bytes read per token,
//   and MLX 0.32's CPU quantized_matmul reads them 4x slower than its
//   float32 BLAS matvec reads 8x the bytes).
//
//   Per output n and group g: scale * dot(q, x_g) + bias * sum(x_g), in
//   float32 (equal to x @ (scale * q + bias) up to rounding). Each row of x
//   is computed alone, the same way whatever other rows are in the call: a
//   row's result does not depend on its batch.
//
// rope(x, dims, traditional, base, scale, offset):
//   mx.fast.rope for float32 x of shape (B, H, T, D) in one op. On a CPU,
//   MLX 0.32 runs mx.fast.rope as its fallback graph of about 20 ops (the
//   positions, the frequencies, cos and sin, the halves, the products,
//   their concatenation), about 80 us a call at one position: 60 calls a
//   token, a fifth of a decode step of the demo model once its matmuls
//   read quantized weights. Same arithmetic in float32: positions
//   (t + offset) * scale, frequencies exp(-i * log(base) / (dims / 2)),
//   then x1 * cos - x2 * sin and x1 * sin + x2 * cos (cos, sin and exp the
//   C library's, where MLX's may differ in a last bit). `offset` is an
//   int32 scalar or one per batch row (a BatchKVCache's).
//
// rms_norm(x, weight, eps):
//   mx.fast.rms_norm for float32 x (..., D) and weight (D,) in one op, where
//   MLX 0.32's CPU fallback is 6 ops (square, mean, add, rsqrt, two
//   products): 61 calls a decode step of the demo model. Same arithmetic:
//   x * rsqrt(mean(x * x) + eps) * weight, the mean a float32 sum over D
//   divided by D (summed in 16 lanes: its last bit may differ from MLX's).

#include <omp.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <string>
#include <stdexcept>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"
#include "mlx/version.h"

namespace mx = mlx::core;
namespace nb = nanobind;
using namespace nb::literals;

// The most rows of x one call takes (its accumulators live on the stack).
constexpr int MAX_ROWS = 16;

namespace {

// Threads a kernel splits a weight over (set_threads): 1 by default, the
// MLX CPU stream thread alone. Through the server on 2 cores a decode step
// was faster on one (44.5 tokens/s on the demo model, against 31-37 on two:
// the second core is the generation thread's and the event loop's).
std::atomic<int> kernel_threads{1};

// Weights of fewer values run on one thread (waking others for a few
// microseconds of work costs more than it saves).
constexpr int64_t PARALLEL_VALUES = 1 << 16;

// Scales and biases to float, one per group. MLX's float16_t converts in
// software on x86 (a third of a 4-bit decode step's time on the demo model);
// the compiler's _Float16 uses the CPU's instruction (F16C) where it has one.
inline float to_float(float v) {
  return v;
}

inline float to_float(mx::float16_t v) {
#ifdef __FLT16_MAX__
  _Float16 h;
  std::memcpy(&h, &v, sizeof(h));
  return static_cast<float>(h);
#else
  return static_cast<float>(v);
#endif
}

inline float to_float(mx::bfloat16_t v) {
  uint16_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  uint32_t wide = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof(f));
  return f;
}

// 16 lanes, written out (GCC/Clang vector extensions) rather than left to
// the auto-vectorizer: every row then runs the same instructions in the same
// order, whatever M, and no float sum is reassociated (a row's result must
// not depend on its batch).
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

// Bytes to floats by way of int32 (GCC 12 converts bytes to floats a lane
// at a time; through int32 it widens and converts in two vector steps).
inline f32x16 to_floats(u8x16 b) {
  return __builtin_convertvector(__builtin_convertvector(b, i32x16), f32x16);
}

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline float sum16(f32x16 v) {
  float t = 0.f;
  for (int i = 0; i < 16; i++) {
    t += v[i];
  }
  return t;
}

// The rows of x split per group into even and odd positions (a 4-bit byte
// holds an even position in its low nibble, the next in its high one).
struct SplitRows {
  std::vector<float> even, odd;
};

SplitRows split_rows(const float* x, int M, int K) {
  SplitRows s;
  s.even.resize(size_t(M) * K / 2);
  s.odd.resize(size_t(M) * K / 2);
  for (size_t i = 0; i < size_t(M) * K / 2; i++) {
    s.even[i] = x[2 * i];
    s.odd[i] = x[2 * i + 1];
  }
  return s;
}

// Each row's sum of x per group (for the biases).
std::vector<float> group_sums(const float* x, int M, int K, int gs) {
  std::vector<float> sums(size_t(M) * (K / gs));
  for (size_t r = 0; r < sums.size(); r++) {
    float t = 0.f;
    for (int k = 0; k < gs; k++) {
      t += x[r * gs + k];
    }
    sums[r] = t;
  }
  return sums;
}


template <int gs, typename T>
void qmv4(const float* x, const uint8_t* w, const T* scales, const T* biases,
          float* out, int M, int N, int K) {
  constexpr int C = gs / 32;  // 16 bytes (32 values) a chunk
  const int G = K / gs;
  const int threads = kernel_threads.load();
  SplitRows s = split_rows(x, M, K);
  std::vector<float> sums = group_sums(x, M, K, gs);
  const float* xe = s.even.data();
  const float* xo = s.odd.data();
  const float* xs = sums.data();
#pragma omp parallel for schedule(static) num_threads(threads) \
    if (threads > 1 && int64_t(N) * K >= PARALLEL_VALUES)
  for (int n = 0; n < N; n++) {
    const uint8_t* wr = w + size_t(n) * K / 2;
    // Per row: scale * (its group's dot, lane by lane) summed over groups in
    // 16 lanes, added up once at the end; bias * sum(x) apart.
    f32x16 acc[MAX_ROWS] = {};
    float acc_bias[MAX_ROWS] = {0};
    for (int g = 0; g < G; g++) {
      f32x16 lo[C], hi[C];
      for (int c = 0; c < C; c++) {
        u8x16 b;
        std::memcpy(&b, wr + g * (gs / 2) + c * 16, 16);
        lo[c] = to_floats(b & 0x0f);
        hi[c] = to_floats(b >> 4);
      }
      const float scale = to_float(scales[size_t(n) * G + g]);
      const float bias = to_float(biases[size_t(n) * G + g]);
      for (int m = 0; m < M; m++) {
        const float* e = xe + size_t(m) * K / 2 + g * (gs / 2);
        const float* o = xo + size_t(m) * K / 2 + g * (gs / 2);
        f32x16 v = lo[0] * load16(e) + hi[0] * load16(o);
        for (int c = 1; c < C; c++) {
          v += lo[c] * load16(e + 16 * c) + hi[c] * load16(o + 16 * c);
        }
        acc[m] += v * scale;
        acc_bias[m] += bias * xs[size_t(m) * G + g];
      }
    }
    for (int m = 0; m < M; m++) {
      out[size_t(m) * N + n] = sum16(acc[m]) + acc_bias[m];
    }
  }
}

template <int gs, typename T>
void qmv8(const float* x, const uint8_t* w, const T* scales, const T* biases,
          float* out, int M, int N, int K) {
  constexpr int C = gs / 16;  // 16 values a chunk
  const int G = K / gs;
  const int threads = kernel_threads.load();
  std::vector<float> sums = group_sums(x, M, K, gs);
  const float* xs = sums.data();
#pragma omp parallel for schedule(static) num_threads(threads) \
    if (threads > 1 && int64_t(N) * K >= PARALLEL_VALUES)
  for (int n = 0; n < N; n++) {
    const uint8_t* wr = w + size_t(n) * K;
    f32x16 acc[MAX_ROWS] = {};  // (as qmv4's)
    float acc_bias[MAX_ROWS] = {0};
    for (int g = 0; g < G; g++) {
      f32x16 q[C];
      for (int c = 0; c < C; c++) {
        u8x16 b;
        std::memcpy(&b, wr + g * gs + c * 16, 16);
        q[c] = to_floats(b);
      }
      const float scale = to_float(scales[size_t(n) * G + g]);
      const float bias = to_float(biases[size_t(n) * G + g]);
      for (int m = 0; m < M; m++) {
        const float* xr = x + size_t(m) * K + g * gs;
        f32x16 v = q[0] * load16(xr);
        for (int c = 1; c < C; c++) {
          v += q[c] * load16(xr + 16 * c);
        }
        acc[m] += v * scale;
        acc_bias[m] += bias * xs[size_t(m) * G + g];
      }
    }
    for (int m = 0; m < M; m++) {
      out[size_t(m) * N + n] = sum16(acc[m]) + acc_bias[m];
    }
  }
}

template <typename T>
void dispatch(int bits, int gs, const float* x, const uint8_t* w, const T* s,
              const T* b, float* out, int M, int N, int K) {
#define CASE(BITS, GS)                          \
  if (bits == BITS && gs == GS) {               \
    return qmv##BITS<GS, T>(x, w, s, b, out, M, N, K); \
  }
  CASE(4, 32) CASE(4, 64) CASE(4, 128)
  CASE(8, 32) CASE(8, 64) CASE(8, 128)
#undef CASE
  throw std::invalid_argument("[quantized_matvec] unsupported bits or group size");
}

}  // namespace

// An input as the kernels read it: row-contiguous. Most already are; for
// the others a copy is made on MLX's stream thread just before the kernel
// (the encoder keeps it until then). This, not an mx::contiguous in the
// graph: that would be one more op per input of every call (4 of a
// matvec's 5 ops, half a decode step's ops on the demo model).
mx::array row_contiguous(const mx::array& a, mx::cpu::CommandEncoder& encoder) {
  if (a.flags().row_contiguous) {
    return a;
  }
  mx::array copy(a.shape(), a.dtype(), nullptr, {});
  copy.set_data(mx::allocator::malloc(copy.nbytes()));
  encoder.add_temporary(copy);
  encoder.dispatch([src = a.data<uint8_t>(), dst = copy.data<uint8_t>(), shape = a.shape(),
                    strides = a.strides(), item = a.itemsize(), n = a.size()]() {
    std::vector<int> at(shape.size(), 0);
    for (size_t i = 0; i < n; i++) {
      int64_t offset = 0;
      for (size_t d = 0; d < shape.size(); d++) {
        offset += int64_t(at[d]) * strides[d];
      }
      std::memcpy(dst + i * item, src + offset * int64_t(item), item);
      for (int d = int(shape.size()) - 1; d >= 0; d--) {
        if (++at[d] < shape[d]) {
          break;
        }
        at[d] = 0;
      }
    }
  });
  return copy;
}

// An op's output allocated, and its inputs as its kernel reads them
// (row_contiguous), registered with the encoder.
std::vector<mx::array> prepare(const std::vector<mx::array>& inputs, mx::array& out,
                               mx::cpu::CommandEncoder& encoder) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  std::vector<mx::array> ready;
  for (auto& a : inputs) {
    ready.push_back(row_contiguous(a, encoder));
    encoder.set_input_array(ready.back());
  }
  encoder.set_output_array(out);
  return ready;
}

class QuantizedMatvec : public mx::Primitive {
 public:
  QuantizedMatvec(mx::Stream stream, int group_size, int bits)
      : mx::Primitive(stream), group_size_(group_size), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override {
    auto& out = outputs[0];
    auto& encoder = mx::cpu::get_command_encoder(stream());
    auto ready = prepare(inputs, out, encoder);
    auto &x = ready[0], &w = ready[1], &scales = ready[2], &biases = ready[3];
    int K = x.shape(-1);
    int N = out.shape(-1);
    int M = int(x.size() / K);
    auto run = [bits = bits_, gs = group_size_, M, N, K,
                x_ptr = x.data<float>(), w_ptr = w.data<uint8_t>(),
                out_ptr = out.data<float>()](auto* s, auto* b) {
      dispatch(bits, gs, x_ptr, w_ptr, s, b, out_ptr, M, N, K);
    };
    switch (scales.dtype()) {
      case mx::float32:
        encoder.dispatch([run, s = scales.data<float>(), b = biases.data<float>()]() { run(s, b); });
        break;
      case mx::float16:
        encoder.dispatch([run, s = scales.data<mx::float16_t>(),
                          b = biases.data<mx::float16_t>()]() { run(s, b); });
        break;
      case mx::bfloat16:
        encoder.dispatch([run, s = scales.data<mx::bfloat16_t>(),
                          b = biases.data<mx::bfloat16_t>()]() { run(s, b); });
        break;
      default:
        throw std::invalid_argument("[quantized_matvec] scales must be floating");
    }
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("[quantized_matvec] CPU only");
  }

  const char* name() const override { return "QuantizedMatvec"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const QuantizedMatvec&>(other);
    return group_size_ == o.group_size_ && bits_ == o.bits_;
  }

 private:
  int group_size_;
  int bits_;
};

mx::array quantized_matvec(const mx::array& x, const mx::array& w,
                           const mx::array& scales, const mx::array& biases,
                           int group_size, int bits, mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu) {
    throw std::invalid_argument("[quantized_matvec] CPU only");
  }
  if (x.dtype() != mx::float32 || w.dtype() != mx::uint32) {
    throw std::invalid_argument("[quantized_matvec] x must be float32, w uint32");
  }
  if (scales.dtype() != biases.dtype() || !mx::issubdtype(scales.dtype(), mx::floating)) {
    throw std::invalid_argument("[quantized_matvec] scales and biases: one floating type");
  }
  if (w.ndim() != 2 || scales.ndim() != 2 || biases.ndim() != 2 || x.ndim() < 1) {
    throw std::invalid_argument("[quantized_matvec] w, scales, biases must be 2-d");
  }
  // (Refused here, not in the kernel: an exception on MLX's stream thread
  // would end the process.)
  if ((bits != 4 && bits != 8) ||
      (group_size != 32 && group_size != 64 && group_size != 128)) {
    throw std::invalid_argument("[quantized_matvec] bits 4 or 8, group size 32, 64 or 128");
  }
  int K = x.shape(-1);
  int N = w.shape(0);
  if (K == 0 || int64_t(w.shape(1)) * 32 != int64_t(K) * bits || K % group_size != 0 ||
      scales.shape(0) != N || scales.shape(1) != K / group_size ||
      biases.shape() != scales.shape()) {
    throw std::invalid_argument("[quantized_matvec] shapes do not match");
  }
  if (int64_t(x.size()) > int64_t(MAX_ROWS) * K) {
    throw std::invalid_argument("[quantized_matvec] at most 16 rows");
  }
  auto shape = x.shape();
  shape.back() = N;
  std::vector<mx::array> inputs = {x, w, scales, biases};
  return mx::array(shape, mx::float32,
                   std::make_shared<QuantizedMatvec>(stream, group_size, bits),
                   std::move(inputs));
}


namespace {

void rope_kernel(const float* x, const int64_t* strides, float* out, const int32_t* offsets,
                 int n_offsets, int B, int H, int T, int D, int dims, bool traditional,
                 float base, float scale) {
  const int half = dims / 2;
  // As the fallback: log(base) / half in double, rounded to float; then
  // each frequency exp(-i * that) in float.
  const float step = static_cast<float>(std::log(static_cast<double>(base)) / half);
  std::vector<float> inv_freqs(half);
  for (int i = 0; i < half; i++) {
    inv_freqs[i] = std::exp(static_cast<float>(-i) * step);
  }
  std::vector<float> cosines(half), sines(half);
  for (int b = 0; b < B; b++) {
    const float offset = static_cast<float>(offsets[n_offsets == 1 ? 0 : b]);
    for (int t = 0; t < T; t++) {
      const float position = (static_cast<float>(t) + offset) * scale;
      for (int i = 0; i < half; i++) {
        const float theta = position * inv_freqs[i];
        cosines[i] = std::cos(theta);
        sines[i] = std::sin(theta);
      }
      for (int h = 0; h < H; h++) {
        // x read through its strides (queries and keys come transposed);
        // the output is row-contiguous.
        const float* xr = x + b * strides[0] + h * strides[1] + t * strides[2];
        const int64_t sd = strides[3];
        float* o = out + ((size_t(b) * H + h) * T + t) * D;
        if (traditional) {
          for (int i = 0; i < half; i++) {
            const float x1 = xr[2 * i * sd], x2 = xr[(2 * i + 1) * sd];
            o[2 * i] = x1 * cosines[i] - x2 * sines[i];
            o[2 * i + 1] = x1 * sines[i] + x2 * cosines[i];
          }
        } else {
          for (int i = 0; i < half; i++) {
            const float x1 = xr[i * sd], x2 = xr[(i + half) * sd];
            o[i] = x1 * cosines[i] - x2 * sines[i];
            o[i + half] = x1 * sines[i] + x2 * cosines[i];
          }
        }
        for (int d = dims; d < D; d++) {
          o[d] = xr[d * sd];
        }
      }
    }
  }
}

}  // namespace

class RoPE : public mx::Primitive {
 public:
  RoPE(mx::Stream stream, int dims, bool traditional, float base, float scale)
      : mx::Primitive(stream), dims_(dims), traditional_(traditional), base_(base),
        scale_(scale) {}

  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override {
    auto& x = inputs[0];
    auto& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    auto offset = row_contiguous(inputs[1], encoder);
    encoder.set_input_array(x);
    encoder.set_input_array(offset);
    encoder.set_output_array(out);
    std::array<int64_t, 4> strides;
    for (int d = 0; d < 4; d++) {
      strides[d] = x.strides()[d];
    }
    encoder.dispatch([x_ptr = x.data<float>(), strides, out_ptr = out.data<float>(),
                      offsets = offset.data<int32_t>(), n_offsets = int(offset.size()),
                      B = x.shape(0), H = x.shape(1), T = x.shape(2), D = x.shape(3),
                      dims = dims_, traditional = traditional_, base = base_,
                      scale = scale_]() {
      rope_kernel(x_ptr, strides.data(), out_ptr, offsets, n_offsets, B, H, T, D, dims,
                  traditional, base, scale);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("[rope] CPU only");
  }

  const char* name() const override { return "mlx_lm_plus.RoPE"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const RoPE&>(other);
    return dims_ == o.dims_ && traditional_ == o.traditional_ && base_ == o.base_ &&
           scale_ == o.scale_;
  }

 private:
  int dims_;
  bool traditional_;
  float base_;
  float scale_;
};

mx::array rope(const mx::array& x, int dims, bool traditional, float base, float scale,
               const mx::array& offset, mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu) {
    throw std::invalid_argument("[rope] CPU only");
  }
  if (x.dtype() != mx::float32 || x.ndim() != 4) {
    throw std::invalid_argument("[rope] x must be float32 of shape (B, H, T, D)");
  }
  if (dims <= 0 || dims % 2 != 0 || dims > x.shape(3)) {
    throw std::invalid_argument("[rope] dims must be even, positive, at most D");
  }
  if (!mx::issubdtype(offset.dtype(), mx::integer) ||
      (offset.size() != 1 && (offset.ndim() != 1 || offset.shape(0) != x.shape(0)))) {
    throw std::invalid_argument("[rope] offset: an integer, or one per batch row");
  }
  // (One offset, or one a row: read as a flat int32 run.)
  auto offsets = offset.dtype() == mx::int32 ? offset : mx::astype(offset, mx::int32, stream);
  std::vector<mx::array> inputs = {x, offsets};
  return mx::array(x.shape(), mx::float32,
                   std::make_shared<RoPE>(stream, dims, traditional, base, scale),
                   std::move(inputs));
}


namespace {

void rms_norm_kernel(const float* x, const float* w, float* out, size_t rows, int D,
                     float eps) {
  for (size_t r = 0; r < rows; r++) {
    const float* xr = x + r * D;
    float* o = out + r * D;
    f32x16 acc = {};
    int d = 0;
    for (; d + 16 <= D; d += 16) {
      f32x16 v = load16(xr + d);
      acc += v * v;
    }
    float sum = sum16(acc);
    for (; d < D; d++) {
      sum += xr[d] * xr[d];
    }
    const float scale = 1.0f / std::sqrt(sum / static_cast<float>(D) + eps);
    for (int i = 0; i < D; i++) {
      o[i] = (xr[i] * scale) * w[i];
    }
  }
}

}  // namespace

class RMSNorm : public mx::Primitive {
 public:
  RMSNorm(mx::Stream stream, float eps) : mx::Primitive(stream), eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override {
    auto& out = outputs[0];
    auto& encoder = mx::cpu::get_command_encoder(stream());
    auto ready = prepare(inputs, out, encoder);
    auto &x = ready[0], &w = ready[1];
    int D = x.shape(-1);
    encoder.dispatch([x_ptr = x.data<float>(), w_ptr = w.data<float>(),
                      out_ptr = out.data<float>(), rows = x.size() / D, D, eps = eps_]() {
      rms_norm_kernel(x_ptr, w_ptr, out_ptr, rows, D, eps);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("[rms_norm] CPU only");
  }

  const char* name() const override { return "mlx_lm_plus.RMSNorm"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const RMSNorm&>(other).eps_;
  }

 private:
  float eps_;
};

mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps,
                   mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu) {
    throw std::invalid_argument("[rms_norm] CPU only");
  }
  if (x.dtype() != mx::float32 || weight.dtype() != mx::float32 || x.ndim() < 1 ||
      weight.ndim() != 1 || weight.shape(0) != x.shape(-1) || x.shape(-1) == 0) {
    throw std::invalid_argument("[rms_norm] float32 x (..., D) and weight (D,)");
  }
  std::vector<mx::array> inputs = {x, weight};
  return mx::array(x.shape(), mx::float32, std::make_shared<RMSNorm>(stream, eps),
                   std::move(inputs));
}

NB_MODULE(_cpu_kernels, m) {
  m.doc() = "mlx_lm_plus's CPU kernels (an MLX extension)";
  m.attr("MAX_ROWS") = MAX_ROWS;
  // The mlx headers this was built against (mx::version() would be the
  // running libmlx's: the same as mx.__version__ whatever was built).
  m.attr("MLX_VERSION_BUILT") = std::to_string(MLX_VERSION_MAJOR) + "." +
                                std::to_string(MLX_VERSION_MINOR) + "." +
                                std::to_string(MLX_VERSION_PATCH);
  m.def("set_threads", [](int n) { kernel_threads.store(n < 1 ? 1 : n); }, "n"_a,
        "The threads a kernel splits a large weight over (OpenMP's; 1 by default).");
  m.def("quantized_matvec", &quantized_matvec, "x"_a, "w"_a, "scales"_a, "biases"_a,
        "group_size"_a, "bits"_a, nb::kw_only(), "stream"_a = nb::none(),
        "x @ dequantize(w, scales, biases).T for at most MAX_ROWS rows of float32 x.");
  m.def("rope", &rope, "x"_a, "dims"_a, "traditional"_a, "base"_a, "scale"_a, "offset"_a,
        nb::kw_only(), "stream"_a = nb::none(),
        "mx.fast.rope for float32 x of shape (B, H, T, D), one op on the CPU.");
  m.def("rms_norm", &rms_norm, "x"_a, "weight"_a, "eps"_a, nb::kw_only(),
        "stream"_a = nb::none(),
        "mx.fast.rms_norm for float32 x (..., D) and weight (D,), one op on the CPU.");
}
