// Python face of CompLL (csrc/compress/). Only raw pointers (as integers) and
// sizes cross this boundary: hipress/compression/ passes tensor.data_ptr().
// Every kernel runs with the GIL released. FormatError becomes
// hipress._C.PayloadError, a subclass of ValueError; std::invalid_argument
// becomes ValueError.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <tuple>
#include <vector>

#include "bindings/registry.h"
#include "compress/compressor.h"
#include "compress/ops.h"

namespace py = pybind11;

namespace hipress {
namespace {

using namespace compress;
// (buffers [(ptr, len)], scalars ptr, rows, cols)
using PyState = std::tuple<std::vector<std::pair<uintptr_t, size_t>>, uintptr_t, size_t, size_t>;

struct StateArg {
  StateView view;
  StateView* ptr = nullptr;
  explicit StateArg(const std::optional<PyState>& s) {
    if (!s) return;
    auto& [bufs, scalars, rows, cols] = *s;
    if (bufs.size() > StateView::kMaxBufs) throw std::invalid_argument("too many state buffers");
    for (size_t i = 0; i < bufs.size(); ++i) {
      view.buf[i] = reinterpret_cast<float*>(bufs[i].first);
      view.len[i] = bufs[i].second;
    }
    view.nbufs = static_cast<int>(bufs.size());
    view.scalars = reinterpret_cast<uint64_t*>(scalars);
    view.rows = rows;
    view.cols = cols;
    ptr = &view;
  }
};

template <class T>
T* P(uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

}  // namespace
}  // namespace hipress

HIPRESS_BINDINGS(compress, m) {
  using namespace hipress;
  using namespace hipress::compress;
  using CPtr = std::shared_ptr<Compressor>;
  using Release = py::call_guard<py::gil_scoped_release>;

  static py::exception<FormatError> payload_error(m, "PayloadError", PyExc_ValueError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const FormatError& e) {
      py::set_error(payload_error, e.what());
    }
  });

  m.attr("compress_header_bytes") = kHeaderBytes;
  m.attr("compress_magic") = kMagic;
  m.attr("compress_format_version") = kFormatVersion;
  m.def("compress_read_header",
        [](uintptr_t header, size_t nbytes) {
          // header: the payload's first kHeaderBytes (or fewer when nbytes is smaller);
          // nbytes: the whole payload's length. Checks magic, version, check and that
          // the body is exactly the rest of the payload (read_header), nothing else.
          const Header h = read_header(P<const uint8_t>(header), nbytes, 0, SIZE_MAX);
          return py::make_tuple(h.algo, h.version, h.bits, h.kind, h.count, h.numel, h.body_bytes,
                                std::vector<uint32_t>(h.words, h.words + 4));
        },
        py::arg("header_ptr"), py::arg("nbytes"),
        "Validated header fields of a payload: (algo, version, bits, kind, count, numel, body_bytes, words).");
  m.def("compress_names", &compressor_names, "Names of the native compressors in the C++ registry.");
  m.def("compress_set_num_threads", &set_num_threads, py::arg("n"));
  m.def("compress_num_threads", &num_threads);

  py::class_<Compressor, CPtr>(m, "NativeCompressor", "A C++ CompLL compressor (see csrc/compress/compressor.h).")
      .def_property_readonly("name", [](const Compressor& c) { return c.info().name; })
      .def_property_readonly("algo_id", [](const Compressor& c) { return c.info().id; })
      .def_property_readonly("category", [](const Compressor& c) { return std::string(category_name(c.info().category)); })
      .def_property_readonly("rate", [](const Compressor& c) { return c.info().rate; })
      .def_property_readonly("aggregatable", [](const Compressor& c) { return c.info().aggregatable; })
      .def_property_readonly("rounds", [](const Compressor& c) { return c.info().rounds; })
      .def("state_buffers",
           [](const Compressor& c, size_t n, size_t rows, size_t cols) {
             std::vector<std::pair<std::string, size_t>> v;
             for (auto& b : c.state_buffers(n, rows, cols)) v.emplace_back(b.name, b.len);
             return v;
           },
           py::arg("n"), py::arg("rows") = 0, py::arg("cols") = 0)
      .def("max_encoded_bytes", &Compressor::max_encoded_bytes, py::arg("n"), py::arg("rows") = 0, py::arg("cols") = 0)
      .def("encode",
           [](const Compressor& c, uintptr_t in, size_t n, uintptr_t out, size_t cap, std::optional<PyState> st,
              uintptr_t residual_in) {
             StateArg s(st);
             if (residual_in && !s.ptr) throw std::invalid_argument("residual_in needs a state to write the residual into");
             if (s.ptr) s.view.residual_in = P<const float>(residual_in);
             py::gil_scoped_release nogil;
             return c.encode(P<const float>(in), n, P<uint8_t>(out), cap, s.ptr);
           },
           py::arg("in_ptr"), py::arg("n"), py::arg("out_ptr"), py::arg("cap"), py::arg("state") = py::none(),
           py::arg("residual_in") = 0)
      .def("decode",
           [](const Compressor& c, uintptr_t in, size_t bytes, uintptr_t out, size_t n, float alpha, bool add) {
             c.decode(P<const uint8_t>(in), bytes, P<float>(out), n, alpha, add);
           },
           py::arg("in_ptr"), py::arg("nbytes"), py::arg("out_ptr"), py::arg("n"), py::arg("alpha") = 1.0f,
           py::arg("add") = false, Release())
      .def("encode_round",
           [](const Compressor& c, int round, uintptr_t in, size_t n, uintptr_t prev, size_t prev_bytes, uintptr_t out,
              size_t cap, std::optional<PyState> st, uintptr_t residual_in) {
             StateArg s(st);
             if (residual_in && (!s.ptr || round != 0))
               throw std::invalid_argument("residual_in is for round 0, with a state to write the residual into");
             if (s.ptr) s.view.residual_in = P<const float>(residual_in);
             py::gil_scoped_release nogil;
             return c.encode_round(round, P<const float>(in), n, P<const uint8_t>(prev), prev_bytes, P<uint8_t>(out), cap,
                                   s.ptr);
           },
           py::arg("round"), py::arg("in_ptr"), py::arg("n"), py::arg("prev_ptr"), py::arg("prev_bytes"),
           py::arg("out_ptr"), py::arg("cap"), py::arg("state"), py::arg("residual_in") = 0)
      .def("finish",
           [](const Compressor& c, uintptr_t in, size_t bytes, uintptr_t out, size_t n, std::optional<PyState> st,
              bool add) {
             StateArg s(st);
             py::gil_scoped_release nogil;
             c.finish(P<const uint8_t>(in), bytes, P<float>(out), n, s.ptr, add);
           },
           py::arg("in_ptr"), py::arg("nbytes"), py::arg("out_ptr"), py::arg("n"), py::arg("state"), py::arg("add") = false)
      .def("combine",
           [](const Compressor& c, uintptr_t a, size_t ab, uintptr_t b, size_t bb, uintptr_t out, size_t cap) {
             return c.combine(P<const uint8_t>(a), ab, P<const uint8_t>(b), bb, P<uint8_t>(out), cap);
           },
           py::arg("a_ptr"), py::arg("a_bytes"), py::arg("b_ptr"), py::arg("b_bytes"), py::arg("out_ptr"), py::arg("cap"),
           Release());

  m.def("compress_create",
        [](const std::string& name, const Params& p) { return CPtr(create_compressor(name, p)); },
        py::arg("name"), py::arg("params") = Params{}, "Instantiate a native compressor from the C++ registry.");
  m.def("compress_error_feedback",
        [](CPtr inner, float beta, float gamma) { return CPtr(std::make_shared<ErrorFeedback>(inner, beta, gamma)); },
        py::arg("inner"), py::arg("beta") = 1.0f, py::arg("gamma") = 1.0f,
        "Wrap a native compressor in the error-feedback decorator (residual = beta*residual + gamma*g).");

  // ---- common operators (for tests, the reference checks and the DSL) --------
  m.def("ops_pack_bits", [](uintptr_t codes, size_t n, int bits, uintptr_t out) {
    ops::pack_bits(P<const uint8_t>(codes), n, bits, P<uint8_t>(out)); }, Release());
  m.def("ops_unpack_bits", [](uintptr_t in, size_t n, int bits, uintptr_t codes) {
    ops::unpack_bits(P<const uint8_t>(in), n, bits, P<uint8_t>(codes)); }, Release());
  m.def("ops_pack_signbits", [](uintptr_t in, size_t n, uintptr_t out) {
    ops::pack_signbits(P<const float>(in), n, P<uint8_t>(out)); }, Release());
  m.def("ops_random_uniform", [](uint64_t seed, uint64_t counter, uintptr_t out, size_t n) {
    ops::random_uniform(rng_key(seed), counter, P<float>(out), n); }, Release());
  m.def("ops_random_index", [](uint64_t seed, uint64_t counter, uint32_t range, uintptr_t out, size_t n) {
    ops::random_index(rng_key(seed), counter, range, P<uint32_t>(out), n); }, Release());
  m.def("ops_reduce_minmax", [](uintptr_t in, size_t n) {
    auto r = ops::reduce_minmax(P<const float>(in), n); return std::make_pair(r.min, r.max); }, Release());
  m.def("ops_reduce_sign_sums", [](uintptr_t in, size_t n) {
    auto r = ops::reduce_sign_sums(P<const float>(in), n);
    return std::make_tuple(r.pos_sum, r.neg_sum, r.pos_count, r.neg_count); }, Release());
  m.def("ops_filter_abs_ge", [](uintptr_t in, size_t n, float thr, uintptr_t idx, uintptr_t val, size_t cap) {
    return ops::filter_abs_ge(P<const float>(in), n, thr, P<uint32_t>(idx), P<float>(val), cap);
  }, Release());
  m.def("ops_topk_abs", [](uintptr_t in, size_t n, size_t k, uintptr_t idx, uintptr_t val, size_t sample, uint64_t seed,
                           uint64_t counter) {
    return ops::topk_abs_exact(P<const float>(in), n, k, P<uint32_t>(idx), P<float>(val), sample, rng_key(seed), counter);
  }, Release());
  m.def("ops_sampled_threshold", [](uintptr_t in, size_t n, double keep, size_t sample, uint64_t seed, uint64_t counter) {
    return ops::sampled_threshold(P<const float>(in), n, keep, sample, rng_key(seed), counter); }, Release());
  m.def("ops_matmul_nn", [](uintptr_t A, uintptr_t B, uintptr_t C, size_t mm, size_t k, size_t n) {
    ops::matmul_nn(P<const float>(A), P<const float>(B), P<float>(C), mm, k, n); }, Release());
  m.def("ops_add_matmul_nn", [](uintptr_t A, uintptr_t X, uintptr_t B, uintptr_t C, size_t mm, size_t k, size_t n) {
    ops::add_matmul_nn(P<float>(A), P<const float>(X), P<const float>(B), P<float>(C), mm, k, n); }, Release());
  m.def("ops_matmul_tn", [](uintptr_t A, uintptr_t B, uintptr_t C, size_t mm, size_t k, size_t n) {
    ops::matmul_tn(P<const float>(A), P<const float>(B), P<float>(C), mm, k, n); }, Release());
  m.def("ops_matmul_nt", [](uintptr_t A, uintptr_t B, uintptr_t C, size_t mm, size_t r, size_t n, float alpha, bool add) {
    ops::matmul_nt(P<const float>(A), P<const float>(B), P<float>(C), mm, r, n, alpha, add); }, Release());
  m.def("ops_orthogonalize", [](uintptr_t Pm, size_t rows, size_t r) { ops::orthogonalize(P<float>(Pm), rows, r); },
        Release());
  m.def("ops_copy_finite", [](uintptr_t out, uintptr_t in, size_t n) {
    return ops::copy_finite(P<float>(out), P<const float>(in), n); }, Release());
  m.def("ops_copy_finite_bf16", [](uintptr_t out, uintptr_t in, size_t n) {
    return ops::copy_finite_bf16(P<uint16_t>(out), P<const float>(in), n); }, Release());
  m.def("ops_bf16_difference", [](uintptr_t out, uintptr_t p, uintptr_t base, size_t n) {
    ops::bf16_difference(P<uint16_t>(out), P<const float>(p), P<const uint16_t>(base), n); }, Release());
  m.def("ops_bf16_average_delta", [](uintptr_t delta, uintptr_t ref, uintptr_t sum, uintptr_t base, uintptr_t sent,
                                     float ranks, size_t n) {
    ops::bf16_average_delta(P<float>(delta), P<uint16_t>(ref), P<const uint16_t>(sum), P<const uint16_t>(base),
                            P<const uint16_t>(sent), ranks, n); }, Release());
  m.def("ops_axpby", [](uintptr_t y, float beta, uintptr_t x, float gamma, size_t n) {
    ops::axpby(P<float>(y), P<const float>(y), beta, P<const float>(x), gamma, n); }, Release());
  m.def("ops_momentum_update", [](uintptr_t u_out, uintptr_t u_in, float m, uintptr_t g, size_t n) {
    ops::momentum_update(P<float>(u_out), P<const float>(u_in), m, P<float>(g), n); }, Release());
  m.def("ops_momentum_update_finite", [](uintptr_t u_out, uintptr_t u_in, float m, uintptr_t g, size_t n) {
    return ops::momentum_update_finite(P<float>(u_out), P<const float>(u_in), m, P<float>(g), n); }, Release());
}
