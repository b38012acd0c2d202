// Native MPI transport on raw byte buffers (HiPress paper 000, §5.1: the bulk step
// runs as one MPI all-to-all). Included only by *_mpi.cc files, which setup.py
// compiles only when an MPI compiler wrapper is found.
//
// Contract:
//   * Every operation moves bytes (MPI_BYTE) between caller-owned buffers; counts are
//     size_t and may exceed INT_MAX (point-to-point messages are cut into 1 GiB chunks,
//     collectives with large counts fall back to point-to-point).
//   * Every wait polls MPI_Test* against a deadline (timeout_s): a peer that died or never
//     arrives ends the wait with a TransportError naming the operation and the ranks whose
//     requests are still pending. Non-blocking collectives cannot name a single culprit, so
//     they name every other rank. After a timeout the communicator is marked broken
//     (requests may still be in flight); every later call fails at once.
//   * A receive checks the size actually sent (MPI_Get_count, MPI_ERR_TRUNCATE): a
//     mismatch is a TransportError naming the sender.
//   * Our communicator is a private MPI_Comm_dup (of COMM_WORLD or of a communicator
//     handed over from mpi4py) with MPI_ERRORS_RETURN, so user traffic never mixes with ours.
//   * Thread use: one thread at a time per communicator (the engine's comm thread);
//     MPI must provide at least MPI_THREAD_SERIALIZED (MULTIPLE is requested).
#pragma once

// The C API only: the deprecated C++ bindings pulled in by mpi.h warn under -Wextra.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace hipress::mpi {

class TransportError : public std::runtime_error {
 public:
  TransportError(std::string op, const std::string& msg, std::vector<int> peers)
      : std::runtime_error(msg), op(std::move(op)), peers(std::move(peers)) {}
  std::string op;
  std::vector<int> peers;
};

// MPI_Init_thread(MULTIPLE) unless MPI is already initialized (e.g. by mpi4py).
// Returns the thread level provided.
int ensure_initialized();
bool we_initialized();
// MPI_Finalize if this library initialized MPI and nobody finalized it yet.
void finalize_if_owned();
int thread_level();

class Comm {
 public:
  // Private duplicate of `parent` (MPI_COMM_WORLD when parent == MPI_COMM_NULL).
  static std::unique_ptr<Comm> dup_of(MPI_Comm parent);
  ~Comm();
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  bool broken() const { return !broken_reason_.empty(); }
  MPI_Comm handle() const { return comm_; }

  void send(const void* buf, size_t n, int dst, int tag, double timeout_s);
  void recv(void* buf, size_t n, int src, int tag, double timeout_s);
  // Either side may be skipped with a null pointer.
  void sendrecv(const void* sbuf, size_t sn, int dst, void* rbuf, size_t rn, int src, int tag, double timeout_s);
  // Many peers at once: every (buffer, bytes, peer) receive and send posted, then all waited for.
  struct Leg {
    uintptr_t buf;
    size_t n;
    int peer;
  };
  void exchange(const std::vector<Leg>& sends, const std::vector<Leg>& recvs, int tag, double timeout_s);
  void alltoallv(const void* sbuf, const std::vector<size_t>& scounts, void* rbuf,
                 const std::vector<size_t>& rcounts, double timeout_s, bool force_p2p);
  void allgather(const void* sbuf, size_t n, void* rbuf, double timeout_s);
  void allgatherv(const void* sbuf, size_t n, void* rbuf, const std::vector<size_t>& rcounts, double timeout_s);
  void bcast(void* buf, size_t n, int root, double timeout_s);
  // In place: the element-wise sum of n floats over the ranks (MPI_Iallreduce, MPI_SUM), in
  // pieces of at most INT_MAX elements; every rank passes the same n.
  void allreduce_f32(float* buf, size_t n, double timeout_s);
  void barrier(double timeout_s);
  // Collective: ranks with the same color (>= 0) form a new communicator ordered by key;
  // color < 0 returns nullptr.
  std::unique_ptr<Comm> split(int color, int key, double timeout_s);
  void free();
  [[noreturn]] void abort(int code);

 private:
  explicit Comm(MPI_Comm c);
  struct Pending {
    MPI_Request req;
    int peer;        // -1: a collective (every other rank)
    bool is_recv;
    size_t expect;   // bytes expected by a receive
  };
  void check_usable(const std::string& op) const;
  // Posts n bytes to/from peer in chunks of at most kChunk (MPI counts are int).
  void post(std::vector<Pending>& p, char* buf, size_t n, int peer, int tag, bool is_recv, const std::string& op);
  void post_send(std::vector<Pending>& p, const void* buf, size_t n, int dst, int tag, const std::string& op);
  void post_recv(std::vector<Pending>& p, void* buf, size_t n, int src, int tag, const std::string& op);
  void wait_all(const std::string& op, std::vector<Pending>& p, double timeout_s);
  [[noreturn]] void fail(const std::string& op, const std::string& msg, std::vector<int> peers);
  std::vector<int> others() const;

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  std::string broken_reason_;
};

}  // namespace hipress::mpi
