#include "transport/mpi_transport.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <numeric>
#include <sstream>

namespace hipress::mpi {
namespace {

constexpr size_t kChunk = size_t(1) << 30;  // largest piece of one point-to-point message
constexpr int kTagA2A = 32001;              // internal tags (user tags are < 32000)
constexpr int kTagAGV = 32002;
std::atomic<bool> g_we_initialized{false};

std::string mpi_error_string(int code) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, buf, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(buf, static_cast<size_t>(len));
}

std::string peers_str(const std::vector<int>& p) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < p.size(); ++i) os << (i ? ", " : "") << p[i];
  os << "]";
  return os.str();
}

bool fits_int(const std::vector<size_t>& counts) {
  size_t total = 0;
  for (size_t c : counts) {
    total += c;
    if (c > static_cast<size_t>(INT_MAX) || total > static_cast<size_t>(INT_MAX)) return false;
  }
  return true;
}

}  // namespace

int ensure_initialized() {
  int inited = 0;
  MPI_Initialized(&inited);
  if (!inited) {
    int provided = 0;
    int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    if (rc != MPI_SUCCESS) throw std::runtime_error("MPI_Init_thread failed: " + mpi_error_string(rc));
    g_we_initialized = true;
  }
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) throw std::runtime_error("MPI was already finalized in this process");
  return thread_level();
}

bool we_initialized() { return g_we_initialized; }

int thread_level() {
  int level = 0;
  MPI_Query_thread(&level);
  return level;
}

void finalize_if_owned() {
  if (!g_we_initialized) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
  g_we_initialized = false;
}

Comm::Comm(MPI_Comm c) : comm_(c) {
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
  MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
}

std::unique_ptr<Comm> Comm::dup_of(MPI_Comm parent) {
  ensure_initialized();
  if (parent == MPI_COMM_NULL) parent = MPI_COMM_WORLD;
  MPI_Comm c = MPI_COMM_NULL;
  int rc = MPI_Comm_dup(parent, &c);
  if (rc != MPI_SUCCESS) throw TransportError("init", "MPI_Comm_dup failed: " + mpi_error_string(rc), {});
  return std::unique_ptr<Comm>(new Comm(c));
}

Comm::~Comm() { free(); }

void Comm::free() {
  if (comm_ == MPI_COMM_NULL) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  // A broken communicator may still have requests in flight: freeing it would be
  // erroneous, so it is leaked (the job is expected to end).
  if (!finalized && broken_reason_.empty()) MPI_Comm_free(&comm_);
  comm_ = MPI_COMM_NULL;
}

void Comm::abort(int code) { MPI_Abort(comm_ == MPI_COMM_NULL ? MPI_COMM_WORLD : comm_, code); std::abort(); }

std::vector<int> Comm::others() const {
  std::vector<int> v;
  for (int r = 0; r < size_; ++r)
    if (r != rank_) v.push_back(r);
  return v;
}

void Comm::check_usable(const std::string& op) const {
  if (comm_ == MPI_COMM_NULL) throw TransportError(op, "the MPI communicator is closed", {});
  if (!broken_reason_.empty())
    throw TransportError(op, "the MPI communicator is unusable after an earlier failure (" + broken_reason_ + ")", {});
}

void Comm::fail(const std::string& op, const std::string& msg, std::vector<int> peers) {
  throw TransportError(op, msg, std::move(peers));
}

void Comm::post(std::vector<Pending>& p, char* buf, size_t n, int peer, int tag, bool is_recv, const std::string& op) {
  size_t off = 0;
  do {  // zero-length messages are posted too: the receiver waits for them
    size_t len = std::min(kChunk, n - off);
    Pending q{MPI_REQUEST_NULL, peer, is_recv, len};
    int count = static_cast<int>(len);
    int rc = is_recv ? MPI_Irecv(buf + off, count, MPI_BYTE, peer, tag, comm_, &q.req)
                     : MPI_Isend(buf + off, count, MPI_BYTE, peer, tag, comm_, &q.req);
    if (rc != MPI_SUCCESS)
      fail(op, std::string(is_recv ? "MPI_Irecv from" : "MPI_Isend to") + " rank " + std::to_string(peer) + ": " +
                   mpi_error_string(rc), {peer});
    p.push_back(q);
    off += len;
  } while (off < n);
}

void Comm::post_send(std::vector<Pending>& p, const void* buf, size_t n, int dst, int tag, const std::string& op) {
  // MPI_Isend never writes to the buffer; the cast only lets one loop serve both directions.
  post(p, const_cast<char*>(static_cast<const char*>(buf)), n, dst, tag, false, op);
}

void Comm::post_recv(std::vector<Pending>& p, void* buf, size_t n, int src, int tag, const std::string& op) {
  post(p, static_cast<char*>(buf), n, src, tag, true, op);
}

void Comm::wait_all(const std::string& op, std::vector<Pending>& p, double timeout_s) {
  using clock = std::chrono::steady_clock;
  const auto deadline = clock::now() + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(timeout_s));
  size_t left = p.size();
  std::vector<bool> done(p.size(), false);
  uint64_t spins = 0;
  while (left > 0) {
    bool progressed = false;
    for (size_t i = 0; i < p.size(); ++i) {
      if (done[i]) continue;
      int flag = 0;
      MPI_Status st;
      int rc = MPI_Test(&p[i].req, &flag, &st);  // single completion: errors come back in rc
      if (rc != MPI_SUCCESS) {
        int code = rc;
        int cls = 0;
        MPI_Error_class(code, &cls);
        std::string who = p[i].peer >= 0 ? "rank " + std::to_string(p[i].peer) : "the other ranks";
        std::vector<int> peers = p[i].peer >= 0 ? std::vector<int>{p[i].peer} : others();
        if (cls == MPI_ERR_TRUNCATE) {
          broken_reason_ = op + ": message truncated";
          fail(op, who + " sent more than the " + std::to_string(p[i].expect) + " bytes this rank expected", peers);
        }
        broken_reason_ = op + ": " + mpi_error_string(code);
        fail(op, "MPI error while talking to " + who + ": " + mpi_error_string(code), peers);
      }
      if (!flag) continue;
      done[i] = true;
      --left;
      progressed = true;
      if (p[i].is_recv && p[i].peer >= 0) {
        int count = 0;
        MPI_Get_count(&st, MPI_BYTE, &count);
        if (static_cast<size_t>(count) != p[i].expect) {
          // The stream is still consistent (the short message was consumed), but any
          // remaining chunks of this message may never come: treat as broken.
          broken_reason_ = op + ": size mismatch";
          fail(op, "rank " + std::to_string(p[i].peer) + " sent " + std::to_string(count) + " bytes but this rank expected " +
                       std::to_string(p[i].expect), {p[i].peer});
        }
      }
    }
    if (left == 0) break;
    if (!progressed) {
      if (++spins > 64) sched_yield();  // oversubscribed ranks must let their peers run
      if ((spins & 15) == 0 && clock::now() > deadline) {
        std::vector<int> waiting;
        for (size_t i = 0; i < p.size(); ++i) {
          if (done[i]) continue;
          if (p[i].peer >= 0) {
            waiting.push_back(p[i].peer);
          } else {
            auto o = others();
            waiting.insert(waiting.end(), o.begin(), o.end());
          }
        }
        std::sort(waiting.begin(), waiting.end());
        waiting.erase(std::unique(waiting.begin(), waiting.end()), waiting.end());
        // Receives can be cancelled so MPI stops writing into the caller's buffer.
        for (size_t i = 0; i < p.size(); ++i) {
          if (!done[i] && p[i].is_recv && p[i].peer >= 0) {
            MPI_Cancel(&p[i].req);
          }
        }
        std::ostringstream os;
        os << "timed out after " << timeout_s << " s waiting for rank(s) " << peers_str(waiting)
           << " (dead, hung, or not calling the same operation)";
        broken_reason_ = op + ": timeout";
        fail(op, os.str(), waiting);
      }
    } else {
      spins = 0;
    }
  }
}

void Comm::send(const void* buf, size_t n, int dst, int tag, double timeout_s) {
  const std::string op = "send";
  check_usable(op);
  std::vector<Pending> p;
  post_send(p, buf, n, dst, tag, op);
  wait_all(op, p, timeout_s);
}

void Comm::recv(void* buf, size_t n, int src, int tag, double timeout_s) {
  const std::string op = "recv";
  check_usable(op);
  std::vector<Pending> p;
  post_recv(p, buf, n, src, tag, op);
  wait_all(op, p, timeout_s);
}

void Comm::sendrecv(const void* sbuf, size_t sn, int dst, void* rbuf, size_t rn, int src, int tag, double timeout_s) {
  const std::string op = "sendrecv";
  check_usable(op);
  std::vector<Pending> p;
  if (rbuf) post_recv(p, rbuf, rn, src, tag, op);
  if (sbuf) post_send(p, sbuf, sn, dst, tag, op);
  wait_all(op, p, timeout_s);
}

void Comm::exchange(const std::vector<Leg>& sends, const std::vector<Leg>& recvs, int tag, double timeout_s) {
  const std::string op = "exchange";
  check_usable(op);
  std::vector<Pending> p;
  for (const Leg& r : recvs) post_recv(p, reinterpret_cast<void*>(r.buf), r.n, r.peer, tag, op);
  for (const Leg& s : sends) post_send(p, reinterpret_cast<const void*>(s.buf), s.n, s.peer, tag, op);
  wait_all(op, p, timeout_s);
}

void Comm::alltoallv(const void* sbuf, const std::vector<size_t>& sc, void* rbuf, const std::vector<size_t>& rc,
                     double timeout_s, bool force_p2p) {
  const std::string op = "alltoallv";
  check_usable(op);
  if (sc.size() != static_cast<size_t>(size_) || rc.size() != static_cast<size_t>(size_))
    fail(op, "counts must have one entry per rank", {});
  std::vector<size_t> sd(size_, 0), rd(size_, 0);
  for (int i = 1; i < size_; ++i) {
    sd[i] = sd[i - 1] + sc[i - 1];
    rd[i] = rd[i - 1] + rc[i - 1];
  }
  std::vector<Pending> p;
  if (!force_p2p && fits_int(sc) && fits_int(rc)) {
    std::vector<int> isc(size_), irc(size_), isd(size_), ird(size_);
    for (int i = 0; i < size_; ++i) {
      isc[i] = static_cast<int>(sc[i]);
      irc[i] = static_cast<int>(rc[i]);
      isd[i] = static_cast<int>(sd[i]);
      ird[i] = static_cast<int>(rd[i]);
    }
    Pending q{MPI_REQUEST_NULL, -1, false, 0};
    int r = MPI_Ialltoallv(sbuf, isc.data(), isd.data(), MPI_BYTE, rbuf, irc.data(), ird.data(), MPI_BYTE, comm_, &q.req);
    if (r != MPI_SUCCESS) fail(op, "MPI_Ialltoallv: " + mpi_error_string(r), others());
    p.push_back(q);
    wait_all(op, p, timeout_s);
    return;
  }
  // Point-to-point: receives first, sends staggered by rank, zero counts skipped
  // (both sides agree on zeros: the Python layer validated the counts).
  const char* s = static_cast<const char*>(sbuf);
  char* r = static_cast<char*>(rbuf);
  for (int k = 1; k < size_; ++k) {
    int src = (rank_ - k + size_) % size_;
    if (rc[src]) post_recv(p, r + rd[src], rc[src], src, kTagA2A, op);
  }
  for (int k = 1; k < size_; ++k) {
    int dst = (rank_ + k) % size_;
    if (sc[dst]) post_send(p, s + sd[dst], sc[dst], dst, kTagA2A, op);
  }
  if (rc[rank_]) std::copy(s + sd[rank_], s + sd[rank_] + rc[rank_], r + rd[rank_]);
  wait_all(op, p, timeout_s);
}

void Comm::allgather(const void* sbuf, size_t n, void* rbuf, double timeout_s) {
  const std::string op = "allgather";
  check_usable(op);
  std::vector<size_t> rc(size_, n);
  if (!fits_int(rc)) {
    allgatherv(sbuf, n, rbuf, rc, timeout_s);
    return;
  }
  std::vector<Pending> p;
  Pending q{MPI_REQUEST_NULL, -1, false, 0};
  int r = MPI_Iallgather(sbuf, static_cast<int>(n), MPI_BYTE, rbuf, static_cast<int>(n), MPI_BYTE, comm_, &q.req);
  if (r != MPI_SUCCESS) fail(op, "MPI_Iallgather: " + mpi_error_string(r), others());
  p.push_back(q);
  wait_all(op, p, timeout_s);
}

void Comm::allgatherv(const void* sbuf, size_t n, void* rbuf, const std::vector<size_t>& rc, double timeout_s) {
  const std::string op = "allgatherv";
  check_usable(op);
  if (rc.size() != static_cast<size_t>(size_)) fail(op, "counts must have one entry per rank", {});
  std::vector<size_t> rd(size_, 0);
  for (int i = 1; i < size_; ++i) rd[i] = rd[i - 1] + rc[i - 1];
  std::vector<Pending> p;
  if (fits_int(rc)) {
    std::vector<int> irc(size_), ird(size_);
    for (int i = 0; i < size_; ++i) {
      irc[i] = static_cast<int>(rc[i]);
      ird[i] = static_cast<int>(rd[i]);
    }
    Pending q{MPI_REQUEST_NULL, -1, false, 0};
    // A send buffer that is this rank's own segment of rbuf (dear's all-gather) must be MPI_IN_PLACE.
    const bool in_place = sbuf == static_cast<const char*>(rbuf) + rd[rank_];
    int r = MPI_Iallgatherv(in_place ? MPI_IN_PLACE : sbuf, static_cast<int>(n), MPI_BYTE, rbuf, irc.data(),
                            ird.data(), MPI_BYTE, comm_, &q.req);
    if (r != MPI_SUCCESS) fail(op, "MPI_Iallgatherv: " + mpi_error_string(r), others());
    p.push_back(q);
    wait_all(op, p, timeout_s);
    return;
  }
  char* r = static_cast<char*>(rbuf);
  for (int k = 1; k < size_; ++k) {
    int src = (rank_ - k + size_) % size_;
    if (rc[src]) post_recv(p, r + rd[src], rc[src], src, kTagAGV, op);
  }
  if (n) {
    for (int k = 1; k < size_; ++k) post_send(p, sbuf, n, (rank_ + k) % size_, kTagAGV, op);
    const char* s = static_cast<const char*>(sbuf);
    if (s != r + rd[rank_]) std::copy(s, s + n, r + rd[rank_]);
  }
  wait_all(op, p, timeout_s);
}

void Comm::bcast(void* buf, size_t n, int root, double timeout_s) {
  const std::string op = "broadcast";
  check_usable(op);
  char* b = static_cast<char*>(buf);
  size_t off = 0;
  do {
    size_t len = std::min(kChunk, n - off);
    std::vector<Pending> p;
    Pending q{MPI_REQUEST_NULL, -1, false, 0};
    int r = MPI_Ibcast(b + off, static_cast<int>(len), MPI_BYTE, root, comm_, &q.req);
    if (r != MPI_SUCCESS) fail(op, "MPI_Ibcast: " + mpi_error_string(r), others());
    p.push_back(q);
    wait_all(op, p, timeout_s);
    off += len;
  } while (off < n);
}

void Comm::allreduce_f32(float* buf, size_t n, double timeout_s) {
  const std::string op = "allreduce";
  check_usable(op);
  const size_t piece = static_cast<size_t>(INT_MAX);
  for (size_t off = 0; off < n; off += piece) {
    size_t len = std::min(piece, n - off);
    std::vector<Pending> p;
    Pending q{MPI_REQUEST_NULL, -1, false, 0};
    int r = MPI_Iallreduce(MPI_IN_PLACE, buf + off, static_cast<int>(len), MPI_FLOAT, MPI_SUM, comm_, &q.req);
    if (r != MPI_SUCCESS) fail(op, "MPI_Iallreduce: " + mpi_error_string(r), others());
    p.push_back(q);
    wait_all(op, p, timeout_s);
  }
}

void Comm::barrier(double timeout_s) {
  const std::string op = "barrier";
  check_usable(op);
  std::vector<Pending> p;
  Pending q{MPI_REQUEST_NULL, -1, false, 0};
  int r = MPI_Ibarrier(comm_, &q.req);
  if (r != MPI_SUCCESS) fail(op, "MPI_Ibarrier: " + mpi_error_string(r), others());
  p.push_back(q);
  wait_all(op, p, timeout_s);
}

std::unique_ptr<Comm> Comm::split(int color, int key, double timeout_s) {
  const std::string op = "split";
  check_usable(op);
  // MPI_Comm_split blocks without a timeout: first make sure every rank is here.
  barrier(timeout_s);
  MPI_Comm c = MPI_COMM_NULL;
  int r = MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &c);
  if (r != MPI_SUCCESS) fail(op, "MPI_Comm_split: " + mpi_error_string(r), others());
  if (c == MPI_COMM_NULL) return nullptr;
  return std::unique_ptr<Comm>(new Comm(c));
}

}  // namespace hipress::mpi
