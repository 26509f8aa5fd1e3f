// Times tile configurations of the sm90 forward kernel against each other, with no PyTorch: the
// candidates of one head dim (TUNE_HEAD_DIM) are compiled into one binary, each run on the FA3
// grid (batch x seqlen = 16k tokens, nheads x d = 2048) and its output compared with the
// first configuration's (a broken configuration shows as a large difference or NaN).
//
//   nvcc -std=c++17 -O3 --use_fast_math --expt-relaxed-constexpr -DNDEBUG -DTUNE_HEAD_DIM=128 \
//        -gencode arch=compute_90a,code=sm_90a -Icsrc -Icsrc/include -I<cutlass>/include \
//        lab/tune_sm90.cu -o tune128 && ./tune128
//
// -DTUNE_FP16 times fp16 instead; -DTUNE_FEATURES=NoProbsStage the kernel without dropout's path (the
// plain kernel of a head dim with a dropout kernel of its own, FwdTraits::kDropoutKernel).
// Environment: TUNE_SEQLENS (comma list, default 1024,2048,4096,8192),
// TUNE_CAUSAL (0 or 1; both when unset), TUNE_ITERS (timed launches, default 20), TUNE_GROUPS
// (comma list of causal tile-group sizes to time with the first configuration; 0 = computed).
//
// The chosen shapes live in csrc/kernels/sm90/tile_config.h; results go to PERFLOG.md.
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#include <cutlass/numeric_types.h>

#include <cstdio>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernels/sm90/fwd_launch.h"

using namespace cutlass_flash;

#ifndef TUNE_FEATURES
#define TUNE_FEATURES AllScoreFeatures
#endif

#ifdef TUNE_FP16
using Element = cutlass::half_t;
constexpr DType kDType = DType::kFloat16;
#else
using Element = cutlass::bfloat16_t;
constexpr DType kDType = DType::kBFloat16;
#endif

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : fallback;
}

std::vector<int> env_ints(const char* name, std::vector<int> fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  std::vector<int> out;
  for (const char* c = v; *c;) {
    out.push_back(std::atoi(c));
    while (*c && *c != ',') ++c;
    if (*c == ',') ++c;
  }
  return out;
}

__global__ void fill_random(Element* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t x = uint32_t(i) * 2654435761u ^ seed;
    x ^= x >> 13; x *= 0x5bd1e995u; x ^= x >> 15;
    p[i] = Element((float(x & 0xffffff) / float(1 << 24) - 0.5f) * 3.46f);  // uniform, unit variance
  }
}

// max |a - b| as float bits (non-negative floats order like their bit patterns); NaN wins.
__global__ void max_abs_diff(const Element* a, const Element* b, size_t n, unsigned* out) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float d = fabsf(float(a[i]) - float(b[i]));
    atomicMax(out, d != d ? 0x7fc00000u : __float_as_uint(d));
  }
}

struct Buffers {
  Element *q, *k, *v, *o, *ref;
  float* lse;
  unsigned* diff;
  void* workspace;
};

template <int kBlockM, int kBlockN, int kStages>
void run_config(const Buffers& b, FwdParams params, size_t o_elems, bool first, int group = 0) {
  using Traits = sm90::FwdTraits<TUNE_HEAD_DIM, kBlockM, kBlockN, kStages, Element>;
  const AttnProblem& p = params.problem;
  cudaMemset(b.o, 0xff, o_elems * sizeof(Element));  // NaN: unwritten elements show
  Status s = sm90::run_fwd_traits<Traits, TUNE_FEATURES>(params, nullptr, group);
  if (!s.ok()) { std::printf("  %dx%dx%d: %s\n", kBlockM, kBlockN, kStages, s.message.c_str()); return; }
  if (first) cudaMemcpy(b.ref, b.o, o_elems * sizeof(Element), cudaMemcpyDeviceToDevice);
  cudaMemset(b.diff, 0, sizeof(unsigned));
  max_abs_diff<<<264, 256>>>(b.o, b.ref, o_elems, b.diff);
  unsigned diff_bits = 0;
  cudaMemcpy(&diff_bits, b.diff, sizeof(unsigned), cudaMemcpyDeviceToHost);
  float diff;
  std::memcpy(&diff, &diff_bits, sizeof(float));
  for (int i = 0; i < 3; ++i) sm90::run_fwd_traits<Traits, TUNE_FEATURES>(params, nullptr, group);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  const int kIters = env_int("TUNE_ITERS", 20);
  cudaEventRecord(e0);
  for (int i = 0; i < kIters; ++i) sm90::run_fwd_traits<Traits, TUNE_FEATURES>(params, nullptr, group);
  cudaEventRecord(e1);
  cudaEventSynchronize(e1);
  float ms = 0.f;
  cudaEventElapsedTime(&ms, e0, e1);
  const double flops = 4.0 * p.batch * p.nheads * double(p.seqlen_q) * p.seqlen_k * p.head_dim / (p.is_causal() ? 2 : 1);
  if (group) std::printf("  group %3d", group);
  std::printf("  %3dx%3dx%d  smem %3d KiB%s  %6.1f TFLOPS  max|O - O_first| %.3g  %s\n", kBlockM, kBlockN, kStages,
              Traits::kSmemBytes / 1024, Traits::kOInV ? " (O in V)  " : "           ",
              flops / (ms / kIters * 1e-3) / 1e12, diff, cudaGetErrorString(cudaGetLastError()));
}


int main() {
  constexpr int d = TUNE_HEAD_DIM;
  const int tokens = 16384, nheads = 2048 / d;
  const size_t elems = size_t(tokens) * nheads * d;
  Buffers b{};
  cudaMalloc(&b.q, elems * sizeof(Element));
  cudaMalloc(&b.k, elems * sizeof(Element));
  cudaMalloc(&b.v, elems * sizeof(Element));
  cudaMalloc(&b.o, elems * sizeof(Element));
  cudaMalloc(&b.ref, elems * sizeof(Element));
  cudaMalloc(&b.lse, size_t(tokens) * nheads * sizeof(float));
  cudaMalloc(&b.diff, sizeof(unsigned));
  cudaMalloc(&b.workspace, 256);
  fill_random<<<1024, 256>>>(b.q, elems, 1);
  fill_random<<<1024, 256>>>(b.k, elems, 2);
  fill_random<<<1024, 256>>>(b.v, elems, 3);
  const int causal_only = env_int("TUNE_CAUSAL", -1);
  const std::vector<int> groups = env_ints("TUNE_GROUPS", {});
  for (int seqlen : env_ints("TUNE_SEQLENS", {1024, 2048, 4096, 8192})) {
    for (bool causal : {false, true}) {
      if (causal_only >= 0 && int(causal) != causal_only) continue;
      FwdParams params{};
      AttnProblem& p = params.problem;
      p.batch = tokens / seqlen;
      p.seqlen_q = p.seqlen_k = seqlen;
      p.nheads = p.nheads_kv = nheads;
      p.head_dim = d;
      p.softmax_scale = 1.f / std::sqrt(float(d));
      p.window_left = -1;
      p.window_right = causal ? 0 : -1;
      p.dtype = kDType;
      auto ref = [&](Element* ptr) {
        return TensorRef4{ptr, int64_t(seqlen) * nheads * d, int64_t(nheads) * d, int64_t(d)};
      };
      params.q = ref(b.q);
      params.k = ref(b.k);
      params.v = ref(b.v);
      params.o = ref(b.o);
      params.lse = b.lse;
      params.workspace = b.workspace;
      std::printf("d=%d seqlen=%d batch=%d nheads=%d causal=%d\n", d, seqlen, p.batch, nheads, int(causal));
      if (causal && !groups.empty()) {
        constexpr sm90::FwdTile kTile = sm90::fwd_tile(TUNE_HEAD_DIM);
        for (size_t i = 0; i < groups.size(); ++i)
          run_config<kTile.block_m, kTile.block_n, kTile.stages>(b, params, elems, i == 0, groups[i]);
        continue;
      }
#if TUNE_HEAD_DIM == 64
      run_config<192, 128, 2>(b, params, elems, true);
      run_config<128, 128, 2>(b, params, elems, false);
      run_config<128, 176, 2>(b, params, elems, false);
#elif TUNE_HEAD_DIM == 96
      run_config<128, 128, 2>(b, params, elems, true);
      run_config<128, 160, 2>(b, params, elems, false);
      run_config<192, 96, 2>(b, params, elems, false);
      run_config<192, 112, 2>(b, params, elems, false);
      run_config<192, 128, 2>(b, params, elems, false);
#elif TUNE_HEAD_DIM == 128
      run_config<128, 128, 2>(b, params, elems, true);
      run_config<128, 144, 2>(b, params, elems, false);
      run_config<128, 160, 2>(b, params, elems, false);
      run_config<128, 176, 2>(b, params, elems, false);
      run_config<128, 192, 2>(b, params, elems, false);
      run_config<192, 80, 2>(b, params, elems, false);
      run_config<192, 96, 2>(b, params, elems, false);
#elif TUNE_HEAD_DIM == 192
      run_config<128, 96, 2>(b, params, elems, true);
      run_config<128, 112, 2>(b, params, elems, false);
#elif TUNE_HEAD_DIM == 256
      run_config<128, 80, 2>(b, params, elems, true);
      run_config<128, 64, 2>(b, params, elems, false);
#endif
    }
  }
  return 0;
}
