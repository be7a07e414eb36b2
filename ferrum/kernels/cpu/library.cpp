// The ops' schemas and CPU implementations, as torch.ops.ferrum_cpu.* (FERRUM_CPU_OPS: another namespace, so
// that a second build can be loaded beside this one, as scripts/cpu_kernel_ab.py does)
#include <torch/library.h>

#include "common.h"

#ifndef FERRUM_CPU_OPS
#define FERRUM_CPU_OPS ferrum_cpu
#endif
// TORCH_LIBRARY pastes its namespace argument unexpanded: one level more expands FERRUM_CPU_OPS first
#define FERRUM_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define FERRUM_LIBRARY_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

FERRUM_LIBRARY(FERRUM_CPU_OPS, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor seq_lens, Tensor query_starts, int block_size, float scale, int window=0, Tensor? k=None, "
      "Tensor? v=None, Tensor? generated=None) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor? residual) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def(
      "rope_write(Tensor(a!) qkv, Tensor positions, Tensor cos_table, Tensor sin_table, Tensor(b!) k_cache, "
      "Tensor(c!) v_cache, Tensor slots, int num_heads, int num_kv_heads) -> ()");
  m.def("int4_gemv(Tensor x, Tensor packed, Tensor scale, Tensor offset, bool zero_point, int group) -> Tensor");
  m.def("int8_gemv(Tensor x, Tensor packed, Tensor scale, int group) -> Tensor");
  m.def("int4_dense_rows() -> int", &ferrum_cpu::int4_dense_rows);  // no tensors to dispatch on: one kernel
  m.def(
      "int4_dequantize(Tensor packed, Tensor scale, Tensor offset, bool zero_point, int group, ScalarType dtype) "
      "-> Tensor");
  m.def("int8_dequantize(Tensor packed, Tensor scale, int group, ScalarType dtype) -> Tensor");
  m.def(
      "decode_layers(Tensor x, Tensor[] norms, Tensor[] weights, int[] layout, Tensor(a!)[] k_caches, "
      "Tensor(b!)[] v_caches, Tensor positions, Tensor cos_table, Tensor sin_table, Tensor slots, "
      "Tensor block_tables, Tensor seq_lens, Tensor query_starts, int block_size, int num_heads, int num_kv_heads, "
      "int head_dim, float eps, int[] windows, Tensor? generated=None) -> Tensor");
  m.def("int8_float_gemv(Tensor x, Tensor weight, Tensor scale, int group) -> Tensor");
  m.def("int4_fit(Tensor weight, int group, bool symmetric, ScalarType params) -> (Tensor, Tensor, Tensor)");
}

FERRUM_LIBRARY_IMPL(FERRUM_CPU_OPS, CPU, m) {
  m.impl("paged_attention", &ferrum_cpu::paged_attention);
  m.impl("rms_norm", &ferrum_cpu::rms_norm);
  m.impl("silu_and_mul", &ferrum_cpu::silu_and_mul);
  m.impl("rope_write", &ferrum_cpu::rope_write);
  m.impl("int4_gemv", &ferrum_cpu::int4_gemv);
  m.impl("int8_gemv", &ferrum_cpu::int8_gemv);
  m.impl("int4_dequantize", &ferrum_cpu::int4_dequantize);
  m.impl("int8_dequantize", &ferrum_cpu::int8_dequantize);
  m.impl("decode_layers", &ferrum_cpu::decode_layers);
  m.impl("int8_float_gemv", &ferrum_cpu::int8_float_gemv);
  m.impl("int4_fit", &ferrum_cpu::int4_fit);
}
