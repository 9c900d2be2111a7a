// kiln's int8 linears for OpenVINO's CPU plugin: each activation row, times its channels' smoothing
// factors, quantized to u8 on the fly (one scale per row, absmax / 127, shifted by 128); weights int8
// per output channel; products on AVX-512 VNNI (vpdpbusd), summed exactly in int32. Compiled with
// AVX-512 flags in a file of its own: the operations' registration (linear_i8_op.cpp) must load on any
// x86-64.
#pragma once
#include <cstddef>
#include <cstdint>

namespace kiln_ov {

// One int8 linear, packed in Python (kiln/compiler/backends/openvino/int8_linears.py): codes
// [N/16][K4][16][4] (K4 = ceil(K/4), N a multiple of 16) of the smoothed weight (W times the
// smoothing factors' inverse per input channel), a float scale per output channel, and comp [N] =
// 128 x the column's sum of codes (what the +128 shift of the activations adds, taken off the sum).
struct PackedLinear {
    const int8_t* codes;
    const float* scale;
    const float* comp;
};

// y[M, N] = x[M, K] W^T; sm [K]: the factor each input channel is multiplied by before quantization
// (SmoothQuant's 1/s: an outlier channel's range moves into the weight, where it costs no row scale)
void linear_i8(const float* x, const float* sm, size_t M, size_t K, PackedLinear w, size_t N, float* y);
// y[M, N] = silu(x Wg^T) * (x Wu^T): Llama's gated MLP input, the rows quantized once
void gate_up_i8(const float* x, const float* sm, size_t M, size_t K, PackedLinear gate, PackedLinear up, size_t N,
                float* y);

}  // namespace kiln_ov
