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
//   divided by D (summed in LANES lanes: its last bit may differ from MLX's).
//
// softmax(x):
//   mx.softmax(x, axis=-1) for float32 x, each row exp(x - max) / sum in
//   float32, exp in 8 lanes (Cephes' expf: range reduction by ln 2, its
//   polynomial, 8e-8 from float64 at most over [-15, 5]; 0 below -87.3, as
//   expf underflows). MLX 0.32's CPU exp runs about 17 ns a value on an
//   AVX2 machine (its wheel is built for any x86-64), 8x NumPy's: attention's
//   softmax was most of a decode step's attention at a long context and
//   nearly all of a long prompt's (cpu_attention.py). A row's values do not
//   depend on the other rows.

#include <omp.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

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

// LANES lanes, written out (GCC/Clang vector extensions) rather than left
// to the auto-vectorizer: every row then runs the same instructions in the
// same order, whatever M, and no float sum is reassociated (a row's result
// must not depend on its batch). One vector register's worth: 16 floats
// with AVX-512, else 8. (Wider than the registers, GCC 12 splits the
// arithmetic but moves bytes and compares a lane at a time: on an AVX2
// machine a 4-bit 1536x576 matvec took 405 us in 16 lanes, 119 in 8 with
// AVX2's byte widening, in a standalone loop.)
#ifdef __AVX512F__
constexpr int LANES = 16;
#else
constexpr int LANES = 8;
#endif
typedef uint8_t u8xL __attribute__((vector_size(LANES)));
typedef float f32xL __attribute__((vector_size(4 * LANES)));
typedef int32_t i32xL __attribute__((vector_size(4 * LANES)));

// LANES bytes at p to floats: all of them (bytes), or their low and high
// nibbles (nibbles). With AVX2 and 8 lanes by its instructions (GCC 12
// moves an 8-byte vector's bytes one at a time); else by way of int32 (GCC
// 12 converts bytes to floats a lane at a time; through int32 it widens and
// converts in two vector steps).
#if defined(__AVX2__) && !defined(__AVX512F__)
inline f32xL widen(__m128i b) {
  const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
  f32xL out;
  std::memcpy(&out, &f, sizeof(out));
  return out;
}

inline f32xL bytes(const uint8_t* p) {
  return widen(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

inline void nibbles(const uint8_t* p, f32xL& lo, f32xL& hi) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i low = _mm_set1_epi8(0x0f);
  lo = widen(_mm_and_si128(b, low));
  hi = widen(_mm_and_si128(_mm_srli_epi16(b, 4), low));
}
#else
inline f32xL to_floats(u8xL b) {
  return __builtin_convertvector(__builtin_convertvector(b, i32xL), f32xL);
}

inline f32xL bytes(const uint8_t* p) {
  u8xL b;
  std::memcpy(&b, p, LANES);
  return to_floats(b);
}

inline void nibbles(const uint8_t* p, f32xL& lo, f32xL& hi) {
  u8xL b;
  std::memcpy(&b, p, LANES);
  lo = to_floats(b & 0x0f);
  hi = to_floats(b >> 4);
}
#endif

inline f32xL loadL(const float* p) {
  f32xL v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline float sumL(f32xL v) {
  float t = 0.f;
  for (int i = 0; i < LANES; i++) {
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


// ROWS: M known when compiled (1: a single stream's decode step, its
// accumulators then held in registers; its arithmetic is the same), or 0.
template <int gs, typename T, int ROWS = 0>
void qmv4(const float* x, const uint8_t* w, const T* scales, const T* biases,
          float* out, int M_, int N, int K) {
  const int M = ROWS ? ROWS : M_;
  constexpr int C = gs / (2 * LANES);  // LANES bytes (2 LANES values) a chunk
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
    // LANES lanes, added up once at the end; bias * sum(x) apart.
    f32xL acc[ROWS ? ROWS : MAX_ROWS];
    float acc_bias[ROWS ? ROWS : MAX_ROWS];
    for (int m = 0; m < M; m++) {
      acc[m] = f32xL{};
      acc_bias[m] = 0.f;
    }
    for (int g = 0; g < G; g++) {
      f32xL lo[C], hi[C];
      for (int c = 0; c < C; c++) {
        nibbles(wr + g * (gs / 2) + c * LANES, lo[c], hi[c]);
      }
      const float scale = to_float(scales[size_t(n) * G + g]);
      const float bias = to_float(biases[size_t(n) * G + g]);
      for (int m = 0; m < M; m++) {
        const float* e = xe + size_t(m) * K / 2 + g * (gs / 2);
        const float* o = xo + size_t(m) * K / 2 + g * (gs / 2);
        f32xL v = lo[0] * loadL(e) + hi[0] * loadL(o);
        for (int c = 1; c < C; c++) {
          v += lo[c] * loadL(e + LANES * c) + hi[c] * loadL(o + LANES * c);
        }
        acc[m] += v * scale;
        acc_bias[m] += bias * xs[size_t(m) * G + g];
      }
    }
    for (int m = 0; m < M; m++) {
      out[size_t(m) * N + n] = sumL(acc[m]) + acc_bias[m];
    }
  }
}

// ROWS: M known when compiled (1: a single stream's decode step, its
// accumulators then held in registers; its arithmetic is the same), or 0.
template <int gs, typename T, int ROWS = 0>
void qmv8(const float* x, const uint8_t* w, const T* scales, const T* biases,
          float* out, int M_, int N, int K) {
  const int M = ROWS ? ROWS : M_;
  constexpr int C = gs / LANES;  // LANES values a chunk
  const int G = K / gs;
  const int threads = kernel_threads.load();
  std::vector<float> sums = group_sums(x, M, K, gs);
  const float* xs = sums.data();
#pragma omp parallel for schedule(static) num_threads(threads) \
    if (threads > 1 && int64_t(N) * K >= PARALLEL_VALUES)
  for (int n = 0; n < N; n++) {
    const uint8_t* wr = w + size_t(n) * K;
    f32xL acc[ROWS ? ROWS : MAX_ROWS];  // (as qmv4's)
    float acc_bias[ROWS ? ROWS : MAX_ROWS];
    for (int m = 0; m < M; m++) {
      acc[m] = f32xL{};
      acc_bias[m] = 0.f;
    }
    for (int g = 0; g < G; g++) {
      f32xL q[C];
      for (int c = 0; c < C; c++) {
        q[c] = bytes(wr + g * gs + c * LANES);
      }
      const float scale = to_float(scales[size_t(n) * G + g]);
      const float bias = to_float(biases[size_t(n) * G + g]);
      for (int m = 0; m < M; m++) {
        const float* xr = x + size_t(m) * K + g * gs;
        f32xL v = q[0] * loadL(xr);
        for (int c = 1; c < C; c++) {
          v += q[c] * loadL(xr + LANES * c);
        }
        acc[m] += v * scale;
        acc_bias[m] += bias * xs[size_t(m) * G + g];
      }
    }
    for (int m = 0; m < M; m++) {
      out[size_t(m) * N + n] = sumL(acc[m]) + acc_bias[m];
    }
  }
}

template <typename T>
void dispatch(int bits, int gs, const float* x, const uint8_t* w, const T* s,
              const T* b, float* out, int M, int N, int K) {
// (Each count of rows up to 8 compiled apart: a call's accumulators then
// live in registers, not on the stack, and the rows after the first cost a
// third as much. A row's arithmetic is the same whatever ROWS.)
#define CASE(BITS, GS)                                                      \
  if (bits == BITS && gs == GS) {                                           \
    switch (M) {                                                            \
      case 1: return qmv##BITS<GS, T, 1>(x, w, s, b, out, M, N, K);         \
      case 2: return qmv##BITS<GS, T, 2>(x, w, s, b, out, M, N, K);         \
      case 3: return qmv##BITS<GS, T, 3>(x, w, s, b, out, M, N, K);         \
      case 4: return qmv##BITS<GS, T, 4>(x, w, s, b, out, M, N, K);         \
      case 5: return qmv##BITS<GS, T, 5>(x, w, s, b, out, M, N, K);         \
      case 6: return qmv##BITS<GS, T, 6>(x, w, s, b, out, M, N, K);         \
      case 7: return qmv##BITS<GS, T, 7>(x, w, s, b, out, M, N, K);         \
      case 8: return qmv##BITS<GS, T, 8>(x, w, s, b, out, M, N, K);         \
      default: return qmv##BITS<GS, T>(x, w, s, b, out, M, N, K);           \
    }                                                                       \
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
    f32xL acc = {};
    int d = 0;
    for (; d + LANES <= D; d += LANES) {
      f32xL v = loadL(xr + d);
      acc += v * v;
    }
    float sum = sumL(acc);
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

namespace {

// 8 lanes (one AVX register; on 16, GCC 12 compiles selects and compares a
// lane at a time without AVX-512), selects written as bit operations.
typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));

inline f32x8 load8(const float* p) {
  f32x8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// a where `mask`, else b.
inline f32x8 pick(i32x8 mask, f32x8 a, f32x8 b) {
  i32x8 ai, bi;
  std::memcpy(&ai, &a, sizeof(ai));
  std::memcpy(&bi, &b, sizeof(bi));
  const i32x8 r = (mask & ai) | (~mask & bi);
  f32x8 out;
  std::memcpy(&out, &r, sizeof(out));
  return out;
}

// exp of 8 floats (Cephes' expf, as in the SSE/AVX ports of it): x = n ln2
// + r, |r| <= ln2 / 2, exp(r) by its polynomial, times 2^n by the exponent
// bits. Below -87.33654 (where expf's result is no longer a normal float)
// 0, as for -inf and MLX's finfo.min of a masked score.
inline f32x8 exp8(f32x8 x) {
  const i32x8 under = x < -87.33654f;
  x = pick(x > 88.3762626647949f, f32x8{} + 88.3762626647949f, x);
  x = pick(under, f32x8{}, x);
  f32x8 fx = x * 1.44269504088896341f + 0.5f;
  // floor: truncate, then one less where that rounded up (negatives).
  const f32x8 t = __builtin_convertvector(__builtin_convertvector(fx, i32x8), f32x8);
  fx = t - __builtin_convertvector(-(t > fx), f32x8);
  x = x - fx * 0.693359375f;
  x = x - fx * -2.12194440e-4f;
  const f32x8 z = x * x;
  f32x8 y = f32x8{} + 1.9875691500e-4f;
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * z + x + 1.0f;
  const i32x8 bits = (__builtin_convertvector(fx, i32x8) + 127) << 23;
  f32x8 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return pick(under, f32x8{}, y * scale);
}

void softmax_kernel(const float* x, float* out, size_t rows, int D) {
  const int full = D / 8 * 8;
  for (size_t r = 0; r < rows; r++) {
    const float* xr = x + r * D;
    float* o = out + r * D;
    f32x8 tops = f32x8{} - INFINITY;
    for (int d = 0; d < full; d += 8) {
      const f32x8 v = load8(xr + d);
      tops = pick(v > tops, v, tops);
    }
    float top = -INFINITY;
    for (int i = 0; i < 8; i++) {
      top = tops[i] > top ? tops[i] : top;
    }
    for (int d = full; d < D; d++) {
      top = xr[d] > top ? xr[d] : top;
    }
    f32x8 acc = {};
    for (int d = 0; d < full; d += 8) {
      const f32x8 e = exp8(load8(xr + d) - top);
      std::memcpy(o + d, &e, sizeof(e));
      acc += e;
    }
    if (full < D) {  // (the tail in a zeroed vector, through the same exp)
      f32x8 v = {};
      std::memcpy(&v, xr + full, sizeof(float) * (D - full));
      const f32x8 e = exp8(v - top);
      for (int i = 0; i < D - full; i++) {
        o[full + i] = e[i];
        acc[i] += e[i];
      }
    }
    float sum = 0.f;
    for (int i = 0; i < 8; i++) {
      sum += acc[i];
    }
    // (A row of -inf, or with a nan: nan throughout, as MLX's.)
    if (top == -INFINITY || std::isnan(top) || std::isnan(sum)) {
      for (int d = 0; d < D; d++) {
        o[d] = NAN;
      }
      continue;
    }
    const float inv = 1.0f / sum;
    int d = 0;
    for (; d < full; d += 8) {
      const f32x8 v = load8(o + d) * inv;
      std::memcpy(o + d, &v, sizeof(v));
    }
    for (; d < D; d++) {
      o[d] *= inv;
    }
  }
}

}  // namespace

class Softmax : public mx::Primitive {
 public:
  explicit Softmax(mx::Stream stream) : mx::Primitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override {
    auto& out = outputs[0];
    auto& encoder = mx::cpu::get_command_encoder(stream());
    auto ready = prepare(inputs, out, encoder);
    auto& x = ready[0];
    int D = x.shape(-1);
    encoder.dispatch([x_ptr = x.data<float>(), out_ptr = out.data<float>(),
                      rows = x.size() / D, D]() { softmax_kernel(x_ptr, out_ptr, rows, D); });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("[softmax] CPU only");
  }

  const char* name() const override { return "mlx_lm_plus.Softmax"; }

  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

mx::array softmax(const mx::array& x, mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu) {
    throw std::invalid_argument("[softmax] CPU only");
  }
  if (x.dtype() != mx::float32 || x.ndim() < 1 || x.shape(-1) == 0) {
    throw std::invalid_argument("[softmax] float32 x (..., D)");
  }
  return mx::array(x.shape(), mx::float32, std::make_shared<Softmax>(stream), {x});
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
  m.def("softmax", &softmax, "x"_a, nb::kw_only(), "stream"_a = nb::none(),
        "mx.softmax(x, axis=-1) for float32 x, one op on the CPU (a vectorized exp).");
}
