// The kernel library's C ABI: plain pointers and sizes, no torch, no Python (a library built
// once per instruction set loads under any torch release; compiled.py's ctypes declarations
// mirror this file, CS_ABI_VERSION tells a stale library from a current one). bf16 values are
// uint16_t bits; every output is allocated by the caller. A function that can fail returns 0,
// or 1 with its message in cs_last_error() (the calling thread's).

#pragma once

#include <stdint.h>

#define CS_ABI_VERSION 1

// The library is built with hidden symbols (-fvisibility=hidden): only these are exported, and
// two variants loaded in one process (the tests load several) share nothing.
#if defined(_WIN32)
#define CS_API __declspec(dllexport)
#else
#define CS_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

// A table of rows (count, d): float32 rows (scales NULL), or int8 q with one scale per group of
// columns, fp16 (Q8_0's d: scale_kind 1) or float32 (Q6_K's d·sc: scale_kind 2).
typedef struct {
  const void* values;  // (count, d) float32, or int8
  const void* scales;  // NULL, or (count, d / group)
  int64_t count, d, group;
  int32_t scale_kind;  // 0 float32 rows, 1 fp16 scales, 2 float32 scales
} cs_rows;

// A linear's weight in one of our layouts (kernels.Int4Linear.use_kernel): int4_mm's tiles
// (N/16, K/8, 16) int32 with scales (N/16, K/32, 2, 16) bf16, the same tiles as AMX's
// (N/16, K/32, 4, 16), or blocks.h's (N/8, K·bits/32, 8) with scales (N/8, K/32, 1 + zeros, 8).
// K counts the input the tiles multiply: `copies` times the layer's input (Q8_0's two halves)
// for int4_mm's tiles, the layer's input itself for blocks.h's, which take it once.
typedef struct {
  const int32_t* tiles;
  const uint16_t* scales;
  int64_t outputs;  // N: 16 per int4_mm tile column, 8 per blocks.h one
  int64_t inputs;   // K
  int32_t layout;   // CS_INT4, CS_INT4_AMX or CS_BLOCKS
  int32_t bits;     // blocks.h: 4, 5 or 8
  int32_t zeros;    // blocks.h: 1 or 2
  int32_t copies;   // int4_mm: the layer's input repeated this many times along K
} cs_linear;

enum { CS_INT4 = 1, CS_INT4_AMX = 2, CS_BLOCKS = 3 };

// What the fused layers read of a model, fixed while it lives (compiled.py builds it once per
// model): per layer l, linears 4l..4l+3 (q/k/v, o, gate/up, down), norms k_norms·l.. (2: before
// attention and before the MLP, 4: after each as well), biases[l] (width,) or none,
// qk_norms[2l], [2l + 1] (head_dim,) or none, windows[l] (0: none), rotary[l] (its table).
typedef struct {
  cs_rows embed;
  const cs_linear* linears;
  const float* const* norms;
  const float* const* biases;    // NULL, or one per layer
  const float* const* qk_norms;  // NULL, or two per layer
  const float* final_norm;
  const int64_t* windows;
  const int64_t* rotary;
  int64_t layers, k_norms, heads, kv_heads, head_dim;
  int32_t activation;  // 0 SiLU, 1 gelu with the tanh approximation
  double eps;
  double embed_scale, attention_scale, residual_scale, attention_cap;
} cs_model;

CS_API const char* cs_last_error(void);
CS_API int32_t cs_abi_version(void);
CS_API const char* cs_variant(void);     // the variant this library was built as (-DCS_VARIANT)
CS_API const char* cs_blocks_isa(void);  // blocks.h's kernels compiled in: "avx2", "neon" or "scalar"
CS_API int32_t cs_avx512_bf16(void);     // whether int4_mm and dense_mm (AVX-512 BF16) are compiled in
CS_API int32_t cs_amx_bf16(void);        // whether AMX tiles are compiled in and granted to this process
CS_API int32_t cs_openmp(void);          // whether the threads are OpenMP's (else std::thread's)

// The layers for n new tokens ids, embedded, rows r taking sizes[r] of them at positions
// starts[r].. into keys[r] (L, KV, capacity / 16, hd, 16) float32 and values[r]
// (L, KV, capacity, hd) bf16; cos, sin (tables, positions, hd). dense: NULL, or per linear its
// bf16 copy in AMX B tiles (N/16, K/32, 16, 32) (a prompt's prefill: on AMX where dense_amx,
// else AVX-512 BF16). features (n, d) float32: the last layer's output after the final norm.
CS_API int32_t cs_fused_layers(const cs_model* model, const int64_t* ids, int64_t n, const float* cos,
                        const float* sin, int64_t tables, int64_t positions, float* const* keys,
                        uint16_t* const* values, const int64_t* capacities, const int64_t* starts,
                        const int64_t* sizes, int64_t rows, const uint16_t* const* dense,
                        int32_t dense_amx, int32_t threads, float* features);

// x (n, K) bf16 times int4_mm's tiles: out (n, N) bf16.
CS_API int32_t cs_int4_mm(const uint16_t* x, int64_t n, const cs_linear* weight, int32_t threads,
                   uint16_t* out);

// x (n, K) bf16 times a bf16 copy in AMX B tiles (blocks × 16 outputs): out (n, 16·blocks) bf16.
CS_API int32_t cs_dense_mm(const uint16_t* x, int64_t n, int64_t K, const uint16_t* tiles,
                    int64_t blocks, int32_t amx, int32_t threads, uint16_t* out);

// x (n, K) bf16 (x_bf16) or float32, int8 per group, times blocks.h's tiles: out (n, N) bf16;
// `reference`: through the scalar reference.
CS_API int32_t cs_blocks_mm(const void* x, int32_t x_bf16, int64_t n, const cs_linear* weight,
                     int32_t reference, int32_t threads, uint16_t* out);

// The Q8_0 LM head (kernels.Q8Head) for x (n, d): its blocks' logits, each legal one that could
// be the largest recomputed in float32 from table; terms (V, 4); legal (n, V) bytes or NULL.
CS_API int32_t cs_q8_head(const float* x, int64_t n, const cs_linear* blocks, const float* terms,
                   const cs_rows* table, const uint8_t* legal, double roundoff, int32_t threads,
                   float* logits);

// Bitmasks (bit t of byte t / 8: token t) as (n, V) bytes 0 or 1.
CS_API void cs_unpack_bits(const uint8_t* const* rows, int64_t n, int64_t V, uint8_t* out);

// Each row's number of nonzero bytes of masks (n, V).
CS_API void cs_count_legal(const uint8_t* masks, int64_t n, int64_t V, int64_t* counts);

#ifdef __cplusplus
}
#endif
