// The `sim` device: a PrivateUse1 backend whose memory is host memory owned by a
// capacity-limited caching allocator per device, whose streams are in-order queues run by
// worker threads (DS_SIM_ASYNC=threads) or only when something waits for them (lazy), and
// whose compute kernels are the host kernels run over device memory after the current
// stream's pending work. See backends/sim/README.md for what each part is for.
#include <torch/extension.h>

#include <ATen/EmptyTensor.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/view_native.h>
#include <ATen/core/op_registration/op_registration.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

namespace sim {

constexpr int kMaxDevices = 16;
constexpr size_t kAlign = 512;  // block rounding, as CUDA's caching allocator rounds

// ------------------------------------------------------------------------ configuration

struct Config {
  int devices = 0;  // 0 until configure(): every entry point refuses before that
  size_t capacity = 0;  // bytes per device
  bool lazy = false;
  double pcie_bytes_per_us = 0.0;  // 0: host<->device copies take no modelled time
};
Config cfg;

void require_configured() {
  TORCH_CHECK(cfg.devices > 0,
              "the sim device is not initialised; call ds_backend_sim.init() (ds_core does "
              "this when the sim backend is selected)");
}

void check_index(int64_t index) {
  require_configured();
  TORCH_CHECK(index >= 0 && index < cfg.devices, "sim:", index,
              " is out of range: this process has ", cfg.devices,
              " sim device(s) (DS_SIM_DEVICES=", cfg.devices, ")");
}

// ------------------------------------------------------------------------ counters

std::atomic<int64_t> host_syncs{0}, h2d_bytes{0}, d2h_bytes{0}, kernels{0}, collectives{0},
    collective_bytes{0};
// Copies the host fallback makes around a host kernel are the kernel's own business, not
// transfers the program asked for.
thread_local bool in_fallback = false;
// Set while this thread runs a queued item (a stream worker, or a waiter in lazy mode).
thread_local bool in_stream_item = false;

// ------------------------------------------------------------------------ GIL-aware waits

// A host thread that holds the GIL must drop it while it waits for device work, because
// that work may be a Python callable (a collective) that needs the GIL to run.
struct NoGil {
  PyThreadState* saved = nullptr;
  NoGil() {
    if (Py_IsInitialized() && PyGILState_Check()) saved = PyEval_SaveThread();
  }
  ~NoGil() {
    if (saved) PyEval_RestoreThread(saved);
  }
};

// ------------------------------------------------------------------------ streams

struct Item {
  std::function<void()> fn;
  int64_t seq;
  double queued_ms;  // host clock when queued
};

double now_ms() {
  using namespace std::chrono;
  return duration<double, std::milli>(steady_clock::now().time_since_epoch()).count();
}

// The device clock at which the running item started. In threads mode it is the host clock.
// In lazy mode work runs when forced, so each stream keeps the clock a device would have:
// an item starts when it was queued or when the stream's previous item ended, whichever is
// later, and lasts as long as it really ran. Events read this clock, so elapsed_time means
// what it means on a GPU in both modes.
thread_local double item_start_ms = 0.0;

struct SimStream {
  int device;
  int64_t id;
  int priority;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Item> queue;
  int64_t enqueued = 0;  // sequence number of the last item queued
  int64_t done = 0;      // sequence number of the last item finished
  bool running = false;  // an item is executing (in lazy mode: on some waiting thread)
  double clock_ms = 0.0;  // lazy mode: the device clock at the end of the last item
  std::exception_ptr error;  // the first failure; raised at the next wait on this stream
  std::string error_text;
};

// The stream whose item this thread runs (with in_stream_item).
thread_local SimStream* running_stream = nullptr;

// Leaked on purpose: worker threads may still wait on these at interpreter exit.
std::mutex& registry_mu = *new std::mutex;
std::vector<std::vector<SimStream*>>& streams = *new std::vector<std::vector<SimStream*>>;

void run_one(SimStream* s, std::unique_lock<std::mutex>& lk) {
  Item item = std::move(s->queue.front());
  s->queue.pop_front();
  s->running = true;
  lk.unlock();
  // Work on a stream is device work: its own copies and kernels neither wait for a stream
  // (they are the stream) nor count as the program's transfers.
  const bool was = in_fallback;
  const bool was_item = in_stream_item;
  SimStream* const was_running = running_stream;
  in_fallback = true;
  in_stream_item = true;
  running_stream = s;
  const double was_start = item_start_ms;
  const double real_start = now_ms();
  item_start_ms = cfg.lazy ? std::max(s->clock_ms, item.queued_ms) : real_start;
  std::exception_ptr error;
  std::string text;
  try {
    item.fn();
  } catch (const std::exception& e) {
    error = std::current_exception();
    text = e.what();
  } catch (...) {
    error = std::current_exception();
    text = "unknown error";
  }
  in_fallback = was;
  in_stream_item = was_item;
  running_stream = was_running;
  const double end_ms = item_start_ms + (now_ms() - real_start);
  item_start_ms = was_start;
  // Drop what the work captured (tensors, whose release may need the GIL) before taking the
  // stream's lock: a host thread holding the GIL may be waiting for that lock.
  item.fn = nullptr;
  lk.lock();
  if (error && !s->error) {
    s->error = error;
    s->error_text = text;
  }
  s->done = item.seq;
  s->clock_ms = end_ms;
  s->running = false;
  s->cv.notify_all();
}

void worker_loop(SimStream* s) {
  std::unique_lock<std::mutex> lk(s->mu);
  for (;;) {
    s->cv.wait(lk, [s] { return !s->queue.empty() && !s->running; });
    run_one(s, lk);
  }
}

SimStream* make_stream(int device, int priority) {
  auto* s = new SimStream();
  s->device = device;
  s->priority = priority;
  {
    std::lock_guard<std::mutex> g(registry_mu);
    s->id = static_cast<int64_t>(streams[device].size());
    streams[device].push_back(s);
  }
  if (!cfg.lazy) std::thread(worker_loop, s).detach();
  return s;
}

SimStream* get_stream(int device, int64_t id) {
  check_index(device);
  std::lock_guard<std::mutex> g(registry_mu);
  auto& list = streams[device];
  TORCH_CHECK(id >= 0 && id < static_cast<int64_t>(list.size()), "sim:", device,
              " has no stream with id ", id);
  return list[id];
}

// Wait until `s` finished everything up to `seq`. In lazy mode the waiting thread runs the
// queued items itself, so work happens only when something waits for it.
void wait_until(SimStream* s, int64_t seq) {
  std::unique_lock<std::mutex> lk(s->mu);
  if (s->done >= seq && !s->error) return;
  if (s->done < seq) {
    NoGil nogil;
    while (s->done < seq) {
      if (cfg.lazy && !s->running && !s->queue.empty()) {
        run_one(s, lk);
      } else {
        s->cv.wait(lk);
      }
    }
  }
  if (s->error) {
    std::string text = s->error_text;
    s->error = nullptr;  // reported once, like a sticky error cleared by its report
    TORCH_CHECK(false, "work queued on sim:", s->device, " stream ", s->id, " failed: ", text);
  }
}

int64_t enqueue(SimStream* s, std::function<void()> fn) {
  std::lock_guard<std::mutex> g(s->mu);
  int64_t seq = ++s->enqueued;
  s->queue.push_back(Item{std::move(fn), seq, now_ms()});
  s->cv.notify_all();
  return seq;
}

void drain(SimStream* s) {
  int64_t seq;
  {
    std::lock_guard<std::mutex> g(s->mu);
    seq = s->enqueued;
  }
  wait_until(s, seq);
}

bool stream_reached(SimStream* s, int64_t seq) {
  std::lock_guard<std::mutex> g(s->mu);
  return s->done >= seq;
}

bool stream_idle(SimStream* s) {
  std::lock_guard<std::mutex> g(s->mu);
  return s->done >= s->enqueued;
}

thread_local int current_device_index = -1;  // -1: not set on this thread, which means 0
thread_local int64_t current_stream_ids[kMaxDevices] = {0};

int current_device() { return current_device_index < 0 ? 0 : current_device_index; }
SimStream* current_stream(int device) { return get_stream(device, current_stream_ids[device]); }

// ------------------------------------------------------------------------ events

struct Mark {
  std::atomic<bool> reached{false};
  double time_ms = 0.0;
};

struct SimEvent {
  bool timing = false;
  // Set by mark_unrecorded: the record that created the event was device.Event's own, so the
  // event has no device yet and its first real record may be on any device (as CUDA's).
  bool unbound = false;
  SimStream* stream = nullptr;
  int64_t seq = 0;
  std::shared_ptr<Mark> mark;
};

void record_event(SimEvent* e, SimStream* s) {
  auto mark = std::make_shared<Mark>();
  e->mark = mark;
  e->stream = s;
  e->seq = enqueue(s, [mark] {
    mark->time_ms = item_start_ms;
    mark->reached = true;
  });
}

// Queue on `waiter` a wait for everything `target` has queued up to `seq`.
void stream_wait(SimStream* waiter, SimStream* target, int64_t seq) {
  if (waiter == target || seq == 0) return;
  enqueue(waiter, [target, seq] { wait_until(target, seq); });
}

// ------------------------------------------------------------------------ allocator

struct Block {
  void* ptr;
  size_t size;  // the block's bytes (what goes back to the cache)
  size_t used;  // the request rounded to kAlign (what counts as allocated)
  int device;
  SimStream* stream;             // the stream current at allocation: its pool gets the block
  std::vector<SimStream*> uses;  // streams record_stream named (under the arena's lock)
};

// A block freed while a stream that record_stream named still had work queued: it goes
// back to the cache only once each such stream has passed the point it had reached at the
// free, as CUDA's caching allocator holds such a block until its events complete. Until
// then it still counts as allocated, as there.
struct PendingFree {
  Block* block;
  std::vector<std::pair<SimStream*, int64_t>> marks;
};

struct Arena {
  std::mutex mu;
  size_t allocated = 0, peak_allocated = 0, reserved = 0, peak_reserved = 0;
  int64_t allocs = 0, frees = 0, ooms = 0, cache_hits = 0, segments = 0;
  int64_t allocated_total = 0, freed_total = 0;  // bytes, since the last accumulated reset
  int64_t live = 0;                              // blocks held by tensors
  // (stream, size) -> free block: one pool per stream, as CUDA's caching allocator keeps.
  // A block freed by the host may still be read or written by work its stream has queued
  // (a stream-ordered free); handed only to later allocations on that stream, the work
  // that uses it next is ordered after. Handed to another stream's allocation, that
  // stream's work could overwrite it before the queued work ran. The pools are merged only
  // by release_cached, after the device's streams drained.
  std::multimap<std::pair<SimStream*, size_t>, void*> cached;
  std::vector<PendingFree> pending;  // freed, waiting for recorded streams
};
Arena* arenas = new Arena[kMaxDevices];

// Hands a freed block to the cache; call with the arena's lock held.
void cache_block(Arena& a, Block* b) {
  a.allocated -= b->used;
  a.frees += 1;
  a.live -= 1;
  a.freed_total += static_cast<int64_t>(b->used);
  a.cached.emplace(std::make_pair(b->stream, b->size), b->ptr);
  delete b;
}

// Caches the pending blocks whose recorded streams have all passed their marks; call with
// the arena's lock held (stream locks are taken inside it, never the other way round: a
// stream item drops what it captured before it takes its stream's lock).
void sweep_pending(Arena& a) {
  auto keep = a.pending.begin();
  for (auto it = a.pending.begin(); it != a.pending.end(); ++it) {
    bool done = true;
    for (auto& [st, seq] : it->marks) done = done && stream_reached(st, seq);
    if (done) {
      cache_block(a, it->block);
    } else {
      if (keep != it) *keep = std::move(*it);
      ++keep;
    }
  }
  a.pending.erase(keep, a.pending.end());
}

void release_cached(Arena& a) {
  sweep_pending(a);
  for (auto& [key, ptr] : a.cached) {
    c10::free_cpu(ptr);
    a.reserved -= key.second;
    a.segments -= 1;
  }
  a.cached.clear();
}

void free_block(void* ctx) {
  auto* b = static_cast<Block*>(ctx);
  Arena& a = arenas[b->device];
  std::lock_guard<std::mutex> g(a.mu);
  std::vector<std::pair<SimStream*, int64_t>> marks;
  for (SimStream* s : b->uses) {
    std::lock_guard<std::mutex> sg(s->mu);
    if (s->done < s->enqueued) marks.emplace_back(s, s->enqueued);
  }
  if (marks.empty()) {
    cache_block(a, b);
  } else {
    a.pending.push_back(PendingFree{b, std::move(marks)});
  }
}

// record_stream: `stream` uses the block behind `ptr`, so a free must not hand the block to
// another allocation before the work `stream` has queued by then ran.
void record_block_stream(const c10::DataPtr& ptr, const c10::Stream& stream) {
  if (ptr.get_deleter() != &free_block) return;  // a zero-byte tensor owns no block
  TORCH_CHECK(stream.device_type() == c10::DeviceType::PrivateUse1,
              "record_stream on a sim tensor takes a sim stream, got one of ",
              stream.device_type());
  auto* b = static_cast<Block*>(ptr.get_context());
  SimStream* s = get_stream(stream.device_index(), stream.id());
  std::lock_guard<std::mutex> g(arenas[b->device].mu);
  for (SimStream* u : b->uses) {
    if (u == s) return;
  }
  b->uses.push_back(s);
}

std::string mib(size_t bytes) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f MiB", static_cast<double>(bytes) / (1 << 20));
  return buf;
}

// Queued work holds raw pointers into blocks freed since it was issued (a stream-ordered
// free, as on a GPU); before cached blocks go back to the host, that work must have run, as
// CUDA's allocator synchronizes before it releases its cache.
void drain_device(int device) {
  std::vector<SimStream*> list;
  {
    std::lock_guard<std::mutex> g(registry_mu);
    list = streams[device];
  }
  for (auto* s : list) drain(s);
}

Block* alloc_block(int device, size_t nbytes) {
  check_index(device);
  size_t size = (nbytes + kAlign - 1) / kAlign * kAlign;
  if (size == 0) size = kAlign;
  const size_t used = size;
  Arena& a = arenas[device];
  // The allocation's stream: the one current on this thread, or for work a stream runs (a
  // queued item allocating), that stream.
  SimStream* stream =
      in_stream_item && running_stream != nullptr && running_stream->device == device
          ? running_stream
          : current_stream(device);
  // A cached block of this stream's pool no more than twice the request, so small tensors
  // do not pin large blocks; end() if none.
  auto fit = [&] {
    auto it = a.cached.lower_bound(std::make_pair(stream, size));
    if (it != a.cached.end() && it->first.first == stream && it->first.second <= 2 * size) {
      return it;
    }
    return a.cached.end();
  };
  std::unique_lock<std::mutex> g(a.mu);
  sweep_pending(a);
  auto it = fit();
  if (it == a.cached.end() && a.reserved + size > cfg.capacity &&
      (!a.cached.empty() || !a.pending.empty()) && !in_stream_item) {
    // Full: the other pools' blocks and the pending frees go back only once the work that
    // may still use them ran. Stream work never drains (it may be the work being waited for).
    g.unlock();
    drain_device(device);
    g.lock();
    sweep_pending(a);
    it = fit();
  }
  void* ptr = nullptr;
  if (it != a.cached.end()) {
    size = it->first.second;
    ptr = it->second;
    a.cached.erase(it);
    a.cache_hits += 1;
  } else {
    if (a.reserved + size > cfg.capacity) release_cached(a);
    if (a.reserved + size > cfg.capacity) {
      a.ooms += 1;
      size_t free_bytes = cfg.capacity - a.reserved;
      TORCH_CHECK_WITH(OutOfMemoryError, false, "sim:", device,
                       " out of memory: tried to allocate ", nbytes, " bytes (", mib(nbytes),
                       "); the device has ", cfg.capacity, " bytes total (", mib(cfg.capacity),
                       "), of which ", free_bytes, " bytes (", mib(free_bytes),
                       ") are free; ", a.allocated, " bytes are allocated by tensors and ",
                       a.reserved, " reserved by the caching allocator. Free tensors, "
                       "or raise DS_SIM_MEMORY_MB.");
    }
    ptr = c10::alloc_cpu(size);
    // Fresh device memory is not zero: reading it before writing shows up as NaNs.
    std::memset(ptr, 0xff, size);
    a.reserved += size;
    a.segments += 1;
    a.peak_reserved = std::max(a.peak_reserved, a.reserved);
  }
  // A reused block may be up to twice the request; CUDA's allocator would split it and
  // count only the part in use as allocated (the rest stays reserved), so allocated counts
  // the rounded request here too: a 2 MiB shard in a cached 4 MiB block is 2 MiB allocated.
  a.allocated += used;
  a.allocs += 1;
  a.live += 1;
  a.allocated_total += static_cast<int64_t>(used);
  a.peak_allocated = std::max(a.peak_allocated, a.allocated);
  return new Block{ptr, size, used, device, stream, {}};
}

// torch's DeviceAllocator, so torch's device-generic memory API (torch.accelerator's
// memory_stats, empty_cache, ..., and Tensor.record_stream) reaches this allocator as it
// reaches CUDA's: torch 2.13 asserts that interface for the current accelerator
// (c10::getDeviceAllocator), and Accelerate empties the cache through it.
struct SimAllocator final : c10::DeviceAllocator {
  bool initialized() override { return cfg.devices > 0; }
  void emptyCache(c10::MempoolId_t mempool_id) override;
  void recordStream(const c10::DataPtr& ptr, c10::Stream stream) override {
    record_block_stream(ptr, stream);
  }
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override;
  void resetAccumulatedStats(c10::DeviceIndex device) override;
  void resetPeakStats(c10::DeviceIndex device) override;
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override;
  c10::DataPtr allocate(size_t nbytes) override {
    int device = current_device();
    if (nbytes == 0) {
      return {nullptr, nullptr, &c10::detail::deleteNothing,
              c10::Device(c10::DeviceType::PrivateUse1, device)};
    }
    Block* b = alloc_block(device, nbytes);
    return {b->ptr, b, &free_block, c10::Device(c10::DeviceType::PrivateUse1, device)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};
SimAllocator allocator;
REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, &allocator);

// Pinned host memory: a separate host allocator that remembers its blocks, so is_pinned()
// and non-blocking copies can tell pinned from pageable memory.
std::mutex& pinned_mu = *new std::mutex;
std::map<uintptr_t, size_t>& pinned_blocks = *new std::map<uintptr_t, size_t>;
std::atomic<int64_t> pinned_bytes{0};

// A pinned block freed while queued copies may still read or write it goes back to the host
// only once every stream has passed the point it had reached at the free, as torch's CUDA
// host allocator holds a block until the events of its copies complete.
struct DeferredFree {
  void* ptr;
  std::vector<std::pair<SimStream*, int64_t>> marks;
};
std::vector<DeferredFree>& deferred_frees = *new std::vector<DeferredFree>;

std::vector<std::pair<SimStream*, int64_t>> busy_streams() {
  std::vector<std::pair<SimStream*, int64_t>> marks;
  std::lock_guard<std::mutex> g(registry_mu);
  for (auto& list : streams) {
    for (auto* s : list) {
      std::lock_guard<std::mutex> sg(s->mu);
      if (s->done < s->enqueued) marks.emplace_back(s, s->enqueued);
    }
  }
  return marks;
}

// Frees the deferred blocks whose copies have all run; call with pinned_mu held.
void sweep_deferred_frees() {
  auto keep = deferred_frees.begin();
  for (auto it = deferred_frees.begin(); it != deferred_frees.end(); ++it) {
    bool done = true;
    for (auto& [st, seq] : it->marks) done = done && stream_reached(st, seq);
    if (done) {
      c10::free_cpu(it->ptr);
    } else {
      if (keep != it) *keep = std::move(*it);  // a self-move would empty the marks
      ++keep;
    }
  }
  deferred_frees.erase(keep, deferred_frees.end());
}

void free_pinned(void* ptr) {
  auto marks = busy_streams();
  std::lock_guard<std::mutex> g(pinned_mu);
  auto it = pinned_blocks.find(reinterpret_cast<uintptr_t>(ptr));
  if (it != pinned_blocks.end()) {
    pinned_bytes -= static_cast<int64_t>(it->second);
    pinned_blocks.erase(it);
  }
  if (marks.empty()) {
    c10::free_cpu(ptr);
  } else {
    deferred_frees.push_back(DeferredFree{ptr, std::move(marks)});
  }
  sweep_deferred_frees();
}

bool is_pinned_ptr(const void* p) {
  auto addr = reinterpret_cast<uintptr_t>(p);
  std::lock_guard<std::mutex> g(pinned_mu);
  auto it = pinned_blocks.upper_bound(addr);
  if (it == pinned_blocks.begin()) return false;
  --it;
  return addr >= it->first && addr < it->first + std::max<size_t>(it->second, 1);
}

struct PinnedAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    void* ptr = c10::alloc_cpu(std::max<size_t>(nbytes, 1));
    {
      std::lock_guard<std::mutex> g(pinned_mu);
      sweep_deferred_frees();
      pinned_blocks[reinterpret_cast<uintptr_t>(ptr)] = nbytes;
    }
    pinned_bytes += static_cast<int64_t>(nbytes);
    return {ptr, ptr, &free_pinned, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_pinned; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};
PinnedAllocator pinned_allocator;

// ------------------------------------------------------------------------ generators

// A sim device's generator reports the sim device, as a vendor's does, and keeps its state
// in a host generator that the host kernels draw from (they accept only host generators).
struct SimGenerator final : c10::GeneratorImpl {
  at::Generator inner;
  SimGenerator(int device, at::Generator host)
      : c10::GeneratorImpl(c10::Device(c10::DeviceType::PrivateUse1, device),
                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
        inner(std::move(host)) {}
  c10::GeneratorImpl* host() const { return inner.unsafeGetGeneratorImpl(); }
  void set_current_seed(uint64_t seed) override { host()->set_current_seed(seed); }
  void set_offset(uint64_t offset) override { host()->set_offset(offset); }
  uint64_t get_offset() const override { return host()->get_offset(); }
  uint64_t current_seed() const override { return host()->current_seed(); }
  uint64_t seed() override { return host()->seed(); }
  void set_state(const c10::TensorImpl& state) override { host()->set_state(state); }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override { return host()->get_state(); }
  SimGenerator* clone_impl() const override {
    return new SimGenerator(device_.index(), inner.clone());
  }
};

std::vector<at::Generator>& generators = *new std::vector<at::Generator>;

const at::Generator& generator(int device) {
  check_index(device);
  return generators[device];
}

// The host generator a host kernel draws from for `gen` (a sim generator, or a host one).
at::Generator host_generator(const at::Generator& gen) {
  if (gen.device().type() == c10::DeviceType::PrivateUse1) {
    return static_cast<SimGenerator*>(gen.unsafeGetGeneratorImpl())->inner;
  }
  return gen;
}

// ------------------------------------------------------------------------ device guard

struct Guard final : c10::impl::DeviceGuardImplInterface {
  static constexpr c10::DeviceType kType = c10::DeviceType::PrivateUse1;
  c10::DeviceType type() const override { return kType; }
  c10::Device exchangeDevice(c10::Device d) const override {
    auto old = getDevice();
    if (d.index() != old.index()) setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(kType, current_device()); }
  void setDevice(c10::Device d) const override {
    check_index(d.index());
    current_device_index = d.index();
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.index() >= 0 && d.index() < cfg.devices) current_device_index = d.index();
  }
  c10::Stream getStream(c10::Device d) const override {
    int i = d.has_index() ? d.index() : current_device();
    check_index(i);
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(kType, i), current_stream_ids[i]);
  }
  c10::Stream getDefaultStream(c10::Device d) const override {
    int i = d.has_index() ? d.index() : current_device();
    check_index(i);
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(kType, i), 0);
  }
  c10::Stream getNewStream(c10::Device d, int priority) const override {
    int i = d.has_index() ? d.index() : current_device();
    check_index(i);
    SimStream* s = make_stream(i, priority);
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(kType, i), s->id);
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool high) const override {
    return getNewStream(d, high ? -1 : 0);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    int i = s.device_index();
    check_index(i);
    get_stream(i, s.id());  // validates the id
    auto old = c10::Stream(c10::Stream::UNSAFE, c10::Device(kType, i), current_stream_ids[i]);
    current_stream_ids[i] = s.id();
    return old;
  }
  c10::DeviceIndex deviceCount() const noexcept override {
    return static_cast<c10::DeviceIndex>(cfg.devices);
  }
  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex device_index,
              const c10::EventFlag flag) const override {
    auto* e = static_cast<SimEvent*>(*event);
    TORCH_CHECK(device_index == -1 || device_index == stream.device_index() || (e && e->unbound),
                "an event of sim:", static_cast<int>(device_index),
                " cannot be recorded on a stream of sim:", static_cast<int>(stream.device_index()));
    if (!e) {
      e = new SimEvent();
      e->timing = flag == c10::EventFlag::BACKEND_DEFAULT;
      *event = e;
    }
    e->unbound = false;
    record_event(e, get_stream(stream.device_index(), stream.id()));
  }
  void block(void* event, const c10::Stream& stream) const override {
    auto* e = static_cast<SimEvent*>(event);
    if (!e || !e->stream) return;  // an event never recorded is complete
    stream_wait(get_stream(stream.device_index(), stream.id()), e->stream, e->seq);
  }
  bool queryEvent(void* event) const override {
    auto* e = static_cast<SimEvent*>(event);
    if (!e || !e->stream) return true;
    // In lazy mode a host observation forces the work: the host waited for the device, which
    // counts as a sync when there was work to run (a real device would have said "not yet").
    if (cfg.lazy && !stream_reached(e->stream, e->seq)) {
      host_syncs += 1;
      wait_until(e->stream, e->seq);
    }
    return e->mark->reached.load();
  }
  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override {
    delete static_cast<SimEvent*>(event);
  }
  void synchronizeEvent(void* event) const override {
    auto* e = static_cast<SimEvent*>(event);
    host_syncs += 1;
    if (!e || !e->stream) return;
    wait_until(e->stream, e->seq);
  }
  double elapsedTime(void* start, void* end, const c10::DeviceIndex) const override {
    auto* a = static_cast<SimEvent*>(start);
    auto* b = static_cast<SimEvent*>(end);
    TORCH_CHECK(a && b && a->stream && b->stream,
                "elapsed_time needs both events recorded first");
    TORCH_CHECK(a->timing && b->timing,
                "elapsed_time needs both events created with enable_timing=True");
    wait_until(a->stream, a->seq);
    wait_until(b->stream, b->seq);
    return b->mark->time_ms - a->mark->time_ms;
  }
  bool queryStream(const c10::Stream& stream) const override {
    SimStream* s = get_stream(stream.device_index(), stream.id());
    if (cfg.lazy && !stream_idle(s)) {  // forced, as queryEvent
      host_syncs += 1;
      drain(s);
    }
    return stream_idle(s);
  }
  void synchronizeStream(const c10::Stream& stream) const override {
    host_syncs += 1;
    drain(get_stream(stream.device_index(), stream.id()));
  }
  void synchronizeDevice(const c10::DeviceIndex index) const override {
    host_syncs += 1;
    int i = index < 0 ? current_device() : index;
    check_index(i);
    std::vector<SimStream*> list;
    {
      std::lock_guard<std::mutex> g(registry_mu);
      list = streams[i];
    }
    for (auto* s : list) drain(s);
  }
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
};
C10_REGISTER_GUARD_IMPL(PrivateUse1, Guard);

// ------------------------------------------------------------------------ hooks

struct Hooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return cfg.devices > 0; }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex index) const override {
    return generator(index < 0 ? current_device() : index);
  }
  at::Device getDeviceFromPtr(void*) const override {
    return at::Device(c10::DeviceType::PrivateUse1, current_device());
  }
  bool isPinnedPtr(const void* data) const override { return is_pinned_ptr(data); }
  c10::Allocator* getPinnedMemoryAllocator() const override { return &pinned_allocator; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override {
    return static_cast<c10::DeviceIndex>(cfg.devices);
  }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override;
};

// ------------------------------------------------------------------------ kernels

at::Tensor host_alias(const at::Tensor& t) {
  // A host tensor over the same bytes: host kernels read and write device memory through it.
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(),
                       at::TensorOptions().dtype(t.dtype()).device(at::kCPU));
}

void model_pcie(size_t bytes) {
  if (cfg.pcie_bytes_per_us > 0.0) {
    auto us = static_cast<int64_t>(static_cast<double>(bytes) / cfg.pcie_bytes_per_us);
    if (us > 0) std::this_thread::sleep_for(std::chrono::microseconds(us));
  }
}

constexpr c10::DispatchKeySet kSimKeys(c10::DispatchKey::PrivateUse1);

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<at::ScalarType> dtype,
                               std::optional<at::Layout> layout,
                               std::optional<at::Device> device, std::optional<bool> pin,
                               std::optional<at::MemoryFormat> memory_format) {
  TORCH_CHECK(!pin.value_or(false), "pin_memory=True is for host tensors, not sim tensors");
  const c10::DeviceGuard guard(device.value_or(at::Device(c10::DeviceType::PrivateUse1)));
  return at::detail::empty_generic(size, &allocator, kSimKeys,
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                         std::optional<at::ScalarType> dtype, std::optional<at::Layout> layout,
                         std::optional<at::Device> device, std::optional<bool> pin) {
  TORCH_CHECK(!pin.value_or(false), "pin_memory=True is for host tensors, not sim tensors");
  const c10::DeviceGuard guard(device.value_or(at::Device(c10::DeviceType::PrivateUse1)));
  return at::detail::empty_strided_generic(size, stride, &allocator, kSimKeys,
                                           c10::dtype_or_default(dtype));
}

void plain_copy(const at::Tensor& dst, const at::Tensor& src) {
  at::Tensor d = dst.is_cpu() ? dst : host_alias(dst);
  at::Tensor s = src.is_cpu() ? src : host_alias(src);
  d.copy_(s);
}

// What a queued copy touches, fixed when it is issued: a device kernel takes its pointers at
// launch, so a storage freed or resized after issuing does not move it. Device blocks freed
// meanwhile are reused only in stream order, pinned host blocks only after the copies queued
// before their free have run (free_pinned), as on a GPU.
at::Tensor at_launch(const at::Tensor& t) { return host_alias(t); }

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  // self is the source.
  TORCH_CHECK(self.sizes() == dst.sizes() || self.numel() == dst.numel() ||
                  self.dim() == 0 || self.numel() == 1,
              "copy between tensors of shapes ", self.sizes(), " and ", dst.sizes());
  if (self.numel() == 0) return dst;
  at::Tensor src = self;
  if (src.sizes() != dst.sizes()) src = src.expand(dst.sizes());
  const bool src_sim = src.device().type() == c10::DeviceType::PrivateUse1;
  const bool dst_sim = dst.device().type() == c10::DeviceType::PrivateUse1;
  if (in_fallback) {  // around a host kernel, after the stream was drained
    plain_copy(dst, src);
    return dst;
  }
  const size_t bytes = static_cast<size_t>(dst.numel()) * dst.element_size();
  if (src_sim && dst_sim) {
    SimStream* d = current_stream(dst.device().index());
    if (src.device().index() != dst.device().index()) {
      SimStream* s = current_stream(src.device().index());
      int64_t seq;
      {
        std::lock_guard<std::mutex> g(s->mu);
        seq = s->enqueued;
      }
      stream_wait(d, s, seq);
    }
    enqueue(d, [to = at_launch(dst), from = at_launch(src)] { plain_copy(to, from); });
    return dst;
  }
  if (dst_sim) {  // host to device
    h2d_bytes += static_cast<int64_t>(bytes);
    SimStream* s = current_stream(dst.device().index());
    if (non_blocking && is_pinned_ptr(src.data_ptr())) {
      enqueue(s, [to = at_launch(dst), from = at_launch(src), bytes] {
        model_pcie(bytes);
        plain_copy(to, from);
      });
      return dst;
    }
    // Pageable memory (or a blocking copy) is copied synchronously: the host waits.
    host_syncs += 1;
    drain(s);
    model_pcie(bytes);
    plain_copy(dst, src);
    return dst;
  }
  // device to host
  d2h_bytes += static_cast<int64_t>(bytes);
  SimStream* s = current_stream(src.device().index());
  if (non_blocking && is_pinned_ptr(dst.data_ptr())) {
    enqueue(s, [to = at_launch(dst), from = at_launch(src), bytes] {
      model_pcie(bytes);
      plain_copy(to, from);
    });
    return dst;
  }
  host_syncs += 1;
  drain(s);
  model_pcie(bytes);
  plain_copy(dst, src);
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  // The host fallback writes results back through here; a strided destination keeps its
  // strides (resizing it to its own sizes would make it contiguous and write outside it).
  if (dst.sizes() != self.sizes()) dst.resize_(self.sizes());
  return copy_from(self, dst, false);
}

at::Scalar local_scalar_dense(const at::Tensor& self) {
  if (!in_fallback) {
    host_syncs += 1;
    d2h_bytes += self.element_size();
    drain(current_stream(self.device().index()));
  }
  return host_alias(self).item();
}

void resize_storage(const c10::Storage& storage, size_t newsize, int device) {
  auto* impl = storage.unsafeGetStorageImpl();
  TORCH_CHECK(impl->resizable(), "this sim storage is not resizable");
  const size_t old = impl->nbytes();
  c10::DataPtr fresh;
  {
    const c10::DeviceGuard guard(at::Device(c10::DeviceType::PrivateUse1, device));
    fresh = allocator.allocate(newsize);
  }
  if (old > 0 && newsize > 0) {
    drain(current_stream(device));
    std::memcpy(fresh.get(), impl->data(), std::min(old, newsize));
  }
  impl->set_data_ptr_noswap(std::move(fresh));
  impl->set_nbytes(newsize);
}

void Hooks::resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const {
  resize_storage(storage, newsize, storage.device().index());
}

const at::Tensor& resize_(const at::Tensor& self, c10::IntArrayRef size,
                          std::optional<at::MemoryFormat> memory_format) {
  auto* impl = self.unsafeGetTensorImpl();
  const bool restride =
      memory_format.has_value() && *memory_format != at::MemoryFormat::Preserve;
  // As torch's resize_: the same sizes leave the tensor (and its strides) alone.
  if (self.sizes() == size && !restride) return self;
  int64_t numel = 1;
  for (auto d : size) {
    TORCH_CHECK(d >= 0, "resize_ needs non-negative sizes, got ", size);
    numel *= d;
  }
  const size_t needed = static_cast<size_t>(self.storage_offset() + numel) * self.element_size();
  if (needed > self.storage().nbytes()) {
    resize_storage(self.storage(), needed, self.device().index());
  }
  impl->set_sizes_contiguous(size);
  if (restride) impl->empty_tensor_restride(*memory_format);
  return self;
}

at::Tensor& set_source_storage_offset(at::Tensor& self, at::Storage source,
                                      int64_t storage_offset, c10::IntArrayRef size,
                                      c10::IntArrayRef stride) {
  TORCH_CHECK(source.device().type() == c10::DeviceType::PrivateUse1,
              "set_ of a sim tensor needs a sim storage, got one on ", source.device());
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(std::move(source));
  impl->set_storage_offset(storage_offset);
  if (stride.empty()) {
    impl->set_sizes_contiguous(size);
  } else {
    impl->set_sizes_and_strides(size, stride);
  }
  return self;
}

at::Tensor& set_source_storage(at::Tensor& self, at::Storage source) {
  int64_t n = static_cast<int64_t>(source.nbytes()) / self.element_size();
  return set_source_storage_offset(self, std::move(source), 0, {n}, {});
}

at::Tensor& set_empty(at::Tensor& self) {
  auto storage = c10::Storage(c10::Storage::use_byte_size_t(), 0, &allocator, true);
  return set_source_storage_offset(self, std::move(storage), 0, {0}, {});
}

at::Tensor view(const at::Tensor& self, c10::IntArrayRef size) {
  return at::native::view(self, size);
}

at::Tensor as_strided(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride,
                      std::optional<int64_t> offset) {
  return at::native::as_strided_tensorimpl(self, size, stride, offset);
}

at::Tensor reshape_alias(const at::Tensor& self, c10::IntArrayRef size,
                         c10::IntArrayRef stride) {
  return at::native::as_strided_tensorimpl(self, size, stride, self.storage_offset());
}

at::Tensor unfold(const at::Tensor& self, int64_t dimension, int64_t size, int64_t step) {
  const int64_t dim = c10::maybe_wrap_dim(dimension, std::max<int64_t>(self.dim(), 1));
  std::vector<int64_t> sizes(self.sizes().begin(), self.sizes().end());
  std::vector<int64_t> strides(self.strides().begin(), self.strides().end());
  const int64_t extent = self.dim() == 0 ? 1 : sizes[dim];
  const int64_t stride = self.dim() == 0 ? 1 : strides[dim];
  TORCH_CHECK(size <= extent, "unfold: size ", size, " exceeds dimension ", dim, " of size ",
              extent);
  TORCH_CHECK(step > 0, "unfold: step must be positive, got ", step);
  if (self.dim() == 0) {
    sizes = {size};
    strides = {1};
  } else {
    sizes[dim] = (extent - size) / step + 1;
    strides[dim] = stride * step;
    sizes.push_back(size);
    strides.push_back(stride);
  }
  return at::native::as_strided_tensorimpl(self, sizes, strides, self.storage_offset());
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("_local_scalar_dense", local_scalar_dense);
  m.impl("resize_", resize_);
  m.impl("set_.source_Storage_storage_offset", set_source_storage_offset);
  m.impl("set_.source_Storage", set_source_storage);
  m.impl("set_", set_empty);
  m.impl("view", view);
  m.impl("as_strided", as_strided);
  m.impl("_reshape_alias", reshape_alias);
  m.impl("unfold", unfold);
}

// ------------------------------------------------------------------------ host fallback

// Every other operator runs its host kernel over the device's memory, after the current
// stream's pending work, once the arguments are checked to live on one sim device (CPU
// scalars aside, as CUDA allows).
void check_devices(const c10::OperatorHandle& op, const torch::jit::Stack& args, int& device) {
  device = -1;
  bool has_cpu = false;
  auto visit = [&](const at::Tensor& t) {
    if (!t.defined()) return;
    if (t.device().type() == c10::DeviceType::PrivateUse1) {
      int i = t.device().index();
      if (device < 0) {
        device = i;
      } else if (device != i) {
        TORCH_CHECK(false, "Expected all tensors to be on the same device, but found at least "
                    "two devices, sim:", device, " and sim:", i, "! (when checking arguments "
                    "for ", op.schema().name(), ")");
      }
    } else if (t.dim() != 0) {
      has_cpu = true;
    }
  };
  for (const auto& v : args) {
    if (v.isTensor()) {
      visit(v.toTensor());
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList()) visit(t);
    } else if (v.isList()) {
      for (const c10::IValue& e : v.toListRef()) {
        if (e.isTensor()) visit(e.toTensor());
      }
    }
  }
  if (device >= 0 && has_cpu) {
    TORCH_CHECK(false, "Expected all tensors to be on the same device, but found at least two "
                "devices, sim:", device, " and cpu! (when checking arguments for ",
                op.schema().name(), ")");
  }
}

void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t n = schema.arguments().size();
  auto args = torch::jit::last(*stack, n);
  int device = -1;
  check_devices(op, args.vec(), device);
  if (device < 0) device = current_device();
  // Random kernels draw from the device's own generator, not the host's.
  for (size_t i = 0; i < n; ++i) {
    const auto& type = schema.arguments()[i].type();
    auto opt = type->cast<c10::OptionalType>();
    if (opt && opt->getElementType()->kind() == c10::TypeKind::GeneratorType) {
      c10::IValue& v = (*stack)[stack->size() - n + i];
      v = c10::IValue(host_generator(v.isNone() ? generator(device) : v.toGenerator()));
    }
  }
  if (!in_fallback) {
    kernels += 1;
    drain(current_stream(device));
  }
  const bool outer = !in_fallback;
  in_fallback = true;
  try {
    const c10::DeviceGuard guard(at::Device(c10::DeviceType::PrivateUse1, device));
    at::native::cpu_fallback(op, stack, /*error_on_views=*/true);
  } catch (...) {
    if (outer) in_fallback = false;
    throw;
  }
  if (outer) in_fallback = false;
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

// Convolutions have composite kernels that would send a device other than CPU/CUDA to
// convolution_overrideable / convolution_backward_overrideable, which torch only declares
// (they raise "not implemented"): the fallback above never saw them, so nn.Conv2d failed on
// sim. Registered here, the two entry points run their host kernels like every other
// operator; autograd still records convolution's own backward.
//
// The reducing losses mse_loss and smooth_l1_loss are structured: without a device kernel their
// functional form allocates a 0-dim result and calls the .out form, whose host kernel sizes
// that result as the elementwise loss before reducing it, and torch warns that it resized a
// non-empty output (a deprecated behaviour, an error in a later torch). Their functional
// forms run the host kernel directly instead.
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("convolution", torch::CppFunction::makeFromBoxedFunction<&fallback>());
  m.impl("convolution_backward", torch::CppFunction::makeFromBoxedFunction<&fallback>());
  m.impl("mse_loss", torch::CppFunction::makeFromBoxedFunction<&fallback>());
  m.impl("smooth_l1_loss", torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

// ------------------------------------------------------------------------ Python API

void configure(int devices, int64_t capacity, bool lazy, double pcie_gbps) {
  TORCH_CHECK(cfg.devices == 0 || (cfg.devices == devices &&
                                   cfg.capacity == static_cast<size_t>(capacity) &&
                                   cfg.lazy == lazy),
              "the sim device is already initialised with other settings in this process");
  if (cfg.devices) return;
  TORCH_CHECK(devices >= 1 && devices <= kMaxDevices, "DS_SIM_DEVICES must be 1..",
              kMaxDevices, ", got ", devices);
  cfg.capacity = static_cast<size_t>(capacity);
  cfg.lazy = lazy;
  cfg.pcie_bytes_per_us = pcie_gbps * 1e3;  // GB/s = 1e9 B/s = 1e3 B/us
  streams.resize(devices);
  for (int i = 0; i < devices; ++i) {
    generators.push_back(at::make_generator<SimGenerator>(
        i, at::make_generator<at::CPUGeneratorImpl>(67280421310721ULL + i)));
  }
  cfg.devices = devices;
  for (int i = 0; i < devices; ++i) make_stream(i, 0);  // the default stream, id 0
  static Hooks* hooks = new Hooks();
  at::RegisterPrivateUse1HooksInterface(hooks);
}

py::dict memory_stats(int device) {
  check_index(device);
  Arena& a = arenas[device];
  std::lock_guard<std::mutex> g(a.mu);
  py::dict d;
  d["allocated_bytes.all.current"] = a.allocated;
  d["allocated_bytes.all.peak"] = a.peak_allocated;
  d["reserved_bytes.all.current"] = a.reserved;
  d["reserved_bytes.all.peak"] = a.peak_reserved;
  d["num_alloc_retries"] = 0;
  d["num_ooms"] = a.ooms;
  d["allocation.all.allocated"] = a.allocs;
  d["allocation.all.freed"] = a.frees;
  d["segment.all.current"] = a.segments;
  d["cache_hits"] = a.cache_hits;
  d["capacity_bytes"] = cfg.capacity;
  return d;
}

void reset_peak(int device) {
  check_index(device);
  Arena& a = arenas[device];
  std::lock_guard<std::mutex> g(a.mu);
  a.peak_allocated = a.allocated;
  a.peak_reserved = a.reserved;
}

void empty_cache() {
  require_configured();
  for (int i = 0; i < cfg.devices; ++i) drain_device(i);
  for (int i = 0; i < cfg.devices; ++i) {
    std::lock_guard<std::mutex> g(arenas[i].mu);
    release_cached(arenas[i]);
  }
}

void SimAllocator::emptyCache(c10::MempoolId_t mempool_id) {
  TORCH_CHECK(mempool_id.first == 0 && mempool_id.second == 0,
              "the sim allocator has no private memory pools (they come with graph capture, "
              "which the sim backend does not declare)");
  empty_cache();
}

c10::CachingDeviceAllocator::DeviceStats SimAllocator::getDeviceStats(c10::DeviceIndex device) {
  check_index(device);
  Arena& a = arenas[device];
  std::lock_guard<std::mutex> g(a.mu);
  c10::CachingDeviceAllocator::DeviceStats st;
  // One pool: everything is the aggregate (index 0), as the Python memory_stats reports.
  constexpr auto kAll = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  auto& allocated = st.allocated_bytes[kAll];
  allocated.current = static_cast<int64_t>(a.allocated);
  allocated.peak = static_cast<int64_t>(a.peak_allocated);
  allocated.allocated = a.allocated_total;
  allocated.freed = a.freed_total;
  // Requested and active bytes are the allocated ones: blocks are not split.
  st.requested_bytes[kAll] = allocated;
  st.active_bytes[kAll] = allocated;
  auto& reserved = st.reserved_bytes[kAll];
  reserved.current = static_cast<int64_t>(a.reserved);
  reserved.peak = static_cast<int64_t>(a.peak_reserved);
  st.allocation[kAll].current = a.live;
  st.allocation[kAll].allocated = a.allocs;
  st.allocation[kAll].freed = a.frees;
  st.segment[kAll].current = a.segments;
  st.num_ooms = a.ooms;
  return st;
}

void SimAllocator::resetAccumulatedStats(c10::DeviceIndex device) {
  check_index(device);
  Arena& a = arenas[device];
  std::lock_guard<std::mutex> g(a.mu);
  a.allocated_total = a.freed_total = 0;
  a.allocs = a.frees = a.ooms = a.cache_hits = 0;
}

void SimAllocator::resetPeakStats(c10::DeviceIndex device) { reset_peak(device); }

std::pair<size_t, size_t> SimAllocator::getMemoryInfo(c10::DeviceIndex device) {
  check_index(device);
  Arena& a = arenas[device];
  std::lock_guard<std::mutex> g(a.mu);
  return {cfg.capacity - a.reserved, cfg.capacity};  // as torch.sim.mem_get_info
}

// Tensor.record_stream on a sim tensor, through the allocator as CUDA's kernel does.
void record_stream(at::Tensor& self, c10::Stream stream) {
  allocator.recordStream(self.storage().data_ptr(), stream);
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) { m.impl("record_stream", record_stream); }

void enqueue_python(int device, int64_t stream_id, py::function fn) {
  SimStream* s = get_stream(device, stream_id);
  auto holder = std::make_shared<py::function>(std::move(fn));
  enqueue(s, [holder] {
    std::string failure;
    {
      py::gil_scoped_acquire gil;
      try {
        (*holder)();
      } catch (py::error_already_set& e) {
        failure = e.what();
      }
      // The callable and what it holds (the collective's buffers) are released here, under
      // the GIL, once it ran.
      *holder = py::function();
    }
    if (!failure.empty()) throw std::runtime_error(failure);
  });
}

}  // namespace sim

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace sim;
  m.def("configure", &configure);
  m.def("device_count", [] { return cfg.devices; });
  m.def("is_lazy", [] { return cfg.lazy; });
  m.def("current_device", [] { return current_device(); });
  m.def("set_device", [](int i) {
    check_index(i);
    current_device_index = i;
  });
  m.def("current_stream_id", [](int i) {
    check_index(i);
    return current_stream_ids[i];
  });
  m.def("exchange_stream", [](int i, int64_t id) {
    get_stream(i, id);
    int64_t old = current_stream_ids[i];
    current_stream_ids[i] = id;
    return old;
  });
  m.def("stream_count", [](int i) {
    check_index(i);
    std::lock_guard<std::mutex> g(registry_mu);
    return streams[i].size();
  });
  m.def("enqueue", &enqueue_python);
  m.def("synchronize", [](int i) {
    host_syncs += 1;
    check_index(i);
    std::vector<SimStream*> list;
    {
      std::lock_guard<std::mutex> g(registry_mu);
      list = streams[i];
    }
    for (auto* s : list) drain(s);
  });
  m.def("drain_current", [](int i) { drain(current_stream(i)); },
        "order the host after the current stream's work without counting a host sync (for "
        "work that runs on the stream itself)");
  m.def("memory_stats", &memory_stats);
  m.def("reset_peak", &reset_peak);
  m.def("empty_cache", &empty_cache);
  m.def("host_alias", [](const at::Tensor& t) {
    TORCH_CHECK(t.device().type() == c10::DeviceType::PrivateUse1, "host_alias takes a sim "
                "tensor, got one on ", t.device());
    return host_alias(t);
  });
  m.def("pinned_bytes", [] { return pinned_bytes.load(); });
  m.def("generator", [](int i) { return generator(i); });
  m.def("counters", [] {
    py::dict d;
    d["host_syncs"] = host_syncs.load();
    d["h2d_bytes"] = h2d_bytes.load();
    d["d2h_bytes"] = d2h_bytes.load();
    d["kernels"] = kernels.load();
    d["collectives"] = collectives.load();
    d["collective_bytes"] = collective_bytes.load();
    return d;
  });
  m.def("reset_counters", [] {
    host_syncs = 0;
    h2d_bytes = 0;
    d2h_bytes = 0;
    kernels = 0;
    collectives = 0;
    collective_bytes = 0;
  });
  m.def("count_collective", [](int64_t bytes) {
    collectives += 1;
    collective_bytes += bytes;
  });
  m.def("count_host_sync", [] { host_syncs += 1; });
  m.def("mark_untimed", [](int64_t event) {
    auto* e = reinterpret_cast<SimEvent*>(event);
    TORCH_CHECK(e != nullptr, "mark_untimed needs a recorded sim event");
    e->timing = false;
  });
  // Forget a record made only to create the event's state (see device.Event): the event is
  // again one never recorded, which query/synchronize/block treat as complete and
  // elapsedTime refuses with torch's RuntimeError.
  m.def("mark_unrecorded", [](int64_t event) {
    auto* e = reinterpret_cast<SimEvent*>(event);
    TORCH_CHECK(e != nullptr, "mark_unrecorded needs a recorded sim event");
    e->unbound = true;
    e->stream = nullptr;
    e->seq = 0;
    e->mark.reset();
  });
}
