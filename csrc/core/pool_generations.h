// PoolGenerations: the lifecycle of one device's CUDA graph memory pool, torch-free.
//
// Every graph of a device is captured into one shared pool, named by an id that torch's
// allocators key their private pools by. The pool is a sequence of generations, each with an
// id of its own: captures go into the current generation; once none of its graphs is left it
// retires for good, and the next capture opens a fresh id (at::cuda::graph_pool_handle()).
//
// The rules this class keeps are torch's (c10/cuda/CUDACachingAllocator.cpp, the
// CachingHostAllocator, ATen/cuda/CUDAGraph.cpp; torch 2.11 to 2.13). Each allocator, the
// device's and the host's, does the same with a pool id:
//   A1 begin (beginAllocateToPool) increfs the pool of that id, creating it when the id is
//      unknown. Increfing a known pool whose use count reached 0 is an internal assert: the
//      process aborts. The id stays known after its count reaches 0, until the allocator
//      frees every block of the pool, which may be never (a cuBLAS workspace made during a
//      capture lives in the pool).
//   A2 begin on an id that is recording already fails, after its incref.
//   A3 end (endAllocateToPool) fails when the id is not recording.
//   A4 release (releasePool) decrefs; below 0 is an internal assert.
//   A5 CUDAGraph::capture_begin runs: begin on the device allocator, begin on the host
//      allocator, cudaStreamBeginCapture. A throw leaves the steps before it done.
//   A6 CUDAGraph::capture_end runs: cudaStreamEndCapture, end on the device, end on the
//      host, then checks the graph. A throw leaves the steps before it done, and the graph
//      then never releases the pool (reset() releases it only for a capture that ended).
//   A7 A graph whose capture ended releases the pool on both allocators when destroyed.
//   A8 Newer torch (2.14 on; torch's main since its #190348): reset(), which the destructor
//      runs, also cleans up a capture that did not end, once both allocators' begins ran
//      (A5): it ends recording where it still runs, then releases the pool on both. Before
//      those begins ran it does nothing. On 2.11 to 2.13 reset() does nothing for such a
//      capture.
//   A9 torch 2.11 and 2.12 (ATen/cuda/CUDAGraph.cpp, CUDAGeneratorImpl.cpp): capture_begin puts
//      the generators the graph registers (the device's default one always) in capture mode
//      first (capture_prologue: the state's capturing_ flag), and only a capture_end that gets
//      past the stream's end and the graph's check takes them out (capture_epilogue). Neither
//      reset() nor the destructor does. A generator left in capture mode raises "Offset
//      increment outside graph capture" on every later replay of any graph and every eager
//      random call of its device. torch 2.13 keeps that state per capture id, dropped by
//      reset(); there the step below does nothing.
//
// What follows, and what this class guarantees:
//   G1 No generation is begun after its use count reached 0 (A1): a retired generation is
//      never captured into again; a fresh id is opened instead.
//   G2 No two captures record into one generation (A2): captures of a device are
//      serialised by its caller; a capture into a recording generation is refused here.
//   G3 A capture that fails is cleaned up on both allocators (A5, A6, A8), once: recording
//      is ended where it was begun, the reference taken is released where the graph will not
//      release it, and the generation retires. Where reset() cleans up (A8) it runs first,
//      and only what it left is ended and released here.
//   G4 Every live graph's generation is counted: a generation retires only when its count
//      of graphs (this class's view of the allocators' use count) returns to 0.
//   G5 A capture that fails leaves no generator in capture mode (A9): end_generator_capture,
//      which does what capture_epilogue does, runs on every failure once begin was called.
#pragma once

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <utility>
#include <vector>

namespace shapecache {

// torch's MempoolId_t (c10/core/Allocator.h), spelled the same so that no conversion is needed.
using PoolId = std::pair<unsigned long long, unsigned long long>;

// What one allocator (the device's or the host's) does with a pool id, as the capture's
// clean-up needs it. Each may throw, as torch's do (A3, A4).
struct PoolAllocatorCalls {
  std::function<void(const PoolId&)> end_recording;  // endAllocateToPool
  std::function<void(const PoolId&)> release;        // releasePool
};

// The steps of one capture, as the CUDA layer runs them (torch's CUDAGraph).
struct CaptureSteps {
  std::function<PoolId()> open_pool;             // a fresh id: at::cuda::graph_pool_handle()
  std::function<void(const PoolId&)> begin;      // CUDAGraph::capture_begin(id)
  std::function<void()> body;                    // run the function being captured
  std::function<void()> end;                     // CUDAGraph::capture_end()
  std::function<bool()> ended;                   // whether the capture ended (the graph then releases the pool)
  PoolAllocatorCalls device;
  PoolAllocatorCalls host;
  std::function<void()> reset;                   // CUDAGraph::reset(), run on a capture that did not end
  bool reset_releases_failed_capture = false;    // A8: torch's reset() cleans up a capture that did not end
  // A9: takes the graph's generators out of capture mode (capture_epilogue's part of it; safe
  // to run twice). Empty where torch keeps no such mode.
  std::function<void()> end_generator_capture = nullptr;
};

class PoolGenerations {
 public:
  struct Generation {
    PoolId id;
    int64_t graphs = 0;      // live graphs captured into it, a capture underway included
    bool recording = false;  // a capture into it is underway
    bool retired = false;    // its count returned to 0, or a capture into it failed: never begun again

    // Graphs may still be captured into it or replayed from it, so its blocks are the cache's.
    // Otherwise they are nobody's, and wait for the allocator's cache to be emptied. A retired
    // generation is still in use while a graph captured before a failed capture lives in it.
    bool in_use() const { return !retired || graphs > 0; }
  };

  // Runs one capture into the current generation (or a fresh one) and returns the id the
  // graph holds. On success the graph counts against that generation until graph_released(id).
  // On failure the allocators are cleaned up (G3) and the error is rethrown.
  PoolId capture(const CaptureSteps& steps) {
    Generation& generation = generation_for_capture(steps.open_pool);
    const PoolId id = generation.id;
    // A5: begin may throw after the device allocator, or both, took a reference and started
    // recording. Ending recording succeeds exactly where it had begun, and there the
    // reference is released too.
    try {
      steps.begin(id);
    } catch (...) {
      end_generator_capture(steps);  // G5: the prologue runs before anything that can fail
      if (steps.reset_releases_failed_capture) try_reset(steps);
      release_where_recording(steps, id);
      retire(find(id));
      throw;
    }
    generation.recording = true;
    ++generation.graphs;
    try {
      steps.body();
    } catch (...) {
      // The capture must end whatever failed inside it. If it ends, the graph exists and
      // releases the pool when destroyed (A7): the caller drops it and reports that with
      // graph_released(). If ending fails too, clean up as below.
      try {
        steps.end();
      } catch (...) {
      }
      end_generator_capture(steps);  // G5: where end failed, its epilogue did not run
      if (steps.ended()) {
        find(id).recording = false;
        retire(find(id));
      } else {
        abandon(steps, id);
      }
      throw;
    }
    try {
      steps.end();
    } catch (...) {
      end_generator_capture(steps);  // G5
      if (steps.ended()) {  // it ended, then failed (instantiating, say): the graph releases the pool (A7)
        find(id).recording = false;
        retire(find(id));
      } else {
        abandon(steps, id);
      }
      throw;
    }
    find(id).recording = false;
    return id;
  }

  // A graph captured into `id` was destroyed (its destructor released the pool: A7).
  void graph_released(const PoolId& id) {
    Generation& generation = find(id);
    if (generation.graphs <= 0) throw std::logic_error("PoolGenerations: a graph released twice");
    if (--generation.graphs == 0) generation.retired = true;
  }

  // The generation new captures go into, if one is open (for the pool's figures).
  const Generation* current() const {
    if (generations_.empty() || generations_.back().retired) return nullptr;
    return &generations_.back();
  }

  // Every generation opened so far, oldest first (retired ones stay listed: the allocator may
  // still hold their blocks until it frees them).
  const std::vector<Generation>& generations() const { return generations_; }

  // The ids of the generations in use (Generation::in_use), or of the others. The two lists
  // together name every generation, each once.
  std::vector<PoolId> ids(bool in_use) const {
    std::vector<PoolId> out;
    for (const Generation& g : generations_) {
      if (g.in_use() == in_use) out.push_back(g.id);
    }
    return out;
  }

  int64_t live_graphs() const {
    int64_t n = 0;
    for (const Generation& g : generations_) n += g.graphs;
    return n;
  }

 private:
  Generation& generation_for_capture(const std::function<PoolId()>& open_pool) {
    if (!generations_.empty() && !generations_.back().retired) {
      if (generations_.back().recording) {
        throw std::logic_error("PoolGenerations: a capture is underway in this pool already; captures of a device "
                               "must take turns");
      }
      return generations_.back();
    }
    const PoolId id = open_pool();
    for (const Generation& g : generations_) {
      if (g.id == id) throw std::logic_error("PoolGenerations: a fresh pool id repeats an earlier generation's");
    }
    generations_.push_back(Generation{id, 0, false, false});
    return generations_.back();
  }

  // A6 failed: the stream capture did not end (or the graph proved invalid after it did).
  // Recording is ended where it still runs (an end that fails had ended already), the
  // reference is released on both allocators (the graph will never release it), and the
  // generation retires.
  void abandon(const CaptureSteps& steps, const PoolId& id) {
    if (steps.reset_releases_failed_capture) {
      // A8: reset() ends recording and releases on both (both begins ran: the capture began).
      try_reset(steps);
      release_where_recording(steps, id);
    } else {
      for (const PoolAllocatorCalls* calls : {&steps.device, &steps.host}) {
        try_call(calls->end_recording, id);
        try_call(calls->release, id);
      }
    }
    Generation& generation = find(id);
    generation.recording = false;
    --generation.graphs;
    retire(generation);
  }

  static void retire(Generation& generation) { generation.retired = true; }

  // Ends recording on each allocator where it still runs, and there releases the reference the
  // begin took: an allocator whose begin never ran, or whose recording reset() ended (and
  // released, A8), is left alone.
  static void release_where_recording(const CaptureSteps& steps, const PoolId& id) {
    for (const PoolAllocatorCalls* calls : {&steps.device, &steps.host}) {
      if (try_call(calls->end_recording, id)) try_call(calls->release, id);
    }
  }

  static void end_generator_capture(const CaptureSteps& steps) {
    if (!steps.end_generator_capture) return;
    try {
      steps.end_generator_capture();
    } catch (...) {
    }
  }

  static void try_reset(const CaptureSteps& steps) {
    try {
      steps.reset();
    } catch (...) {
    }
  }

  static bool try_call(const std::function<void(const PoolId&)>& call, const PoolId& id) {
    try {
      call(id);
      return true;
    } catch (...) {
      return false;
    }
  }

  Generation& find(const PoolId& id) {
    for (Generation& g : generations_) {
      if (g.id == id) return g;
    }
    throw std::logic_error("PoolGenerations: no generation has this pool id");
  }

  std::vector<Generation> generations_;
};

}  // namespace shapecache
