// mirrored._core.Rendezvous: the rendezvous of a strategy.run's replicas
// (python/mirrored/distribute/distribute_lib.py `_Group` is this type) and the
// cooperative scheduler of the replicas that run as greenlets on the run's
// caller's thread (python/mirrored/distribute/mirrored_strategy.py).
//
// Why native: a collective inside strategy.run costs, per replica, an arrival,
// a park and a resume. In Python each of those is several frames (about 18 us
// for 4 replicas, four times the all-reduce itself); here each is one call
// (docs/architecture.md, "Replica hand-offs", has the numbers). For the same
// reason the replica pool's per-replica work is here too: running a replica
// and keeping its result or error, claiming the next one, counting arrivals,
// and saving and restoring the thread state (the CUDA part included) of a
// replica that parks (docs/gpu_call_path.md, "The rendezvous runs the replicas"),
// and the replicas' one body around the step: its context, device and, on a
// GPU, stream, inside md.function or not ("GPU replicas run natively", "One
// replica body"). md.get_replica_context and a repeated
// ReplicaContext.all_reduce are builtins here too: every replica's collective
// starts with them.
//
// Every field is read and written with the GIL held and no Python code runs
// between a check and the update it guards, so the GIL alone serialises the
// replicas on threads and the greenlets; the only lock is the one a replica on
// a thread of its own sleeps on, with the GIL released. The combine and the
// greenlet switches are Python calls: a field they may change is read again
// after them.
#include "bindings/rendezvous_binding.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <vector>

namespace mirrored::bindings {
namespace {

enum Waiter { kThread, kHub, kGreenlet };

struct State {
  int n = 0;
  std::vector<PyObject*> slots;  // each replica's payload of the collective under way (owned; null: none)
  std::vector<PyObject*> kinds;  // the collective each replica called last (owned; null: none yet)
  int arrived = 0;
  int finished = 0;                  // replicas whose function returned
  long generation = 0;               // collectives completed this run
  PyObject* results = nullptr;       // the latest combine's results, or the exception it raised
  PyObject* broken = nullptr;        // the exception every waiting replica raises, once the group broke
  PyObject* order = nullptr;         // GPU replicas' MergeOrder (device/gpu.py), else null
  // order.arrival_parts(): (each replica's CUDA ordinal or None, cupy.cuda.get_current_stream, the replica
  // streams' handles, device/gpu.py), what note_arrival() reads; null without an order.
  PyObject* arrival_parts = nullptr;
  PyObject* aborted_type = nullptr;  // distribute_lib._Aborted
  PyObject* tracing = nullptr;       // () -> whether the timeline records (mirrored.timeline.enabled), or a
                                     // (module, name) pair: module.name is true while it records
  PyObject* traced = nullptr;        // (group, rid, kind, payload, combine) -> exchange inside a timeline span

  // The replica pool (set once by pool()): how it hears of a run's end and is asked whether a step is
  // long; and this run's function, outputs, claims and arrivals (reset()). A claim is an atomic
  // dict.setdefault (GIL held) that replica threads make too.
  PyObject* fn = nullptr;           // this run's replica function: fn(i) is replica i's result
  PyObject* outputs = nullptr;      // this run's [replica i's result] (a list)
  PyObject* errors = nullptr;       // this run's exceptions raised in replicas, first first (a list)
  PyObject* complete = nullptr;     // () -> the last of replicas 1..n-1 arrived, on a thread of its own
  PyObject* wake = nullptr;         // () -> whether the step is long (its replicas not started yet go to the threads)
  double handoff = 0;               // seconds a step runs before the claims ask wake()
  PyObject* claims = nullptr;       // this run's {index: token of whoever runs it}, or null: the caller runs all
  PyObject* mine = nullptr;         // the caller's token
  PyObject* arrived_flags = nullptr;  // this run's [whether replica i arrived] (a list), or null
  int next = 0;                     // the next replica the caller may claim
  int arrivals = 0;                 // of replicas 1..n-1
  bool completed = false;           // the last of them arrived on the caller's thread (complete() not called)
  bool woken = true;                // the threads were woken this run (wake() is not asked again)
  std::chrono::steady_clock::time_point started;

  // The thread state replicas that share a thread take along (set once by cooperate()).
  std::vector<PyObject*> state_locals;  // (object, name, default) triples read and set directly
  // GPU replicas' CUDA part: (running, getDevice, setDevice, get_current_stream, ordinals), or null.
  PyObject* running = nullptr;         // a threading.local whose .scope is the running replica's _GpuReplicaScope
  PyObject* get_device = nullptr;
  PyObject* set_device = nullptr;
  PyObject* current_stream = nullptr;  // (ordinal) -> that GPU's current stream
  PyObject* ordinals = nullptr;        // a tuple of ints
  bool has_state = false;              // cooperate() was called

  // The caller's thread's own dicts of the plain threading.locals above (and the replica body's): an attribute
  // of a threading.local is found through the thread state's dict and a name check at every access (~550
  // instructions a set, ~400 a get, CPython 3.11), the thread's dict of it directly in ~100. A thread's dict
  // of a local lives as long as both, so it is looked up once per thread (reset(), by the run's caller) and
  // used only on that thread (a thread state's id is never reused, unlike its address or the thread's ident).
  std::vector<PyObject*> tls_locals;  // the locals (owned), plain threading.locals whose names are no type attribute
  std::vector<PyObject*> tls_dicts;   // each one's dict on thread `tls_thread` (owned), or null
  uint64_t tls_thread = 0;            // PyThreadState_GetID of that thread (0: none yet)
  std::vector<int> state_tls;         // each state_locals triple's local's index in tls_locals (-1: untracked)
  int running_tls = -1;               // running's
  int body_tls[4] = {-1, -1, -1, -1};  // body_locals'
  PyObject* stack_local[2] = {};       // (local, name) of the thread's context stack (exchange()'s check), or nulls
  int stack_tls = -1;                  // its local's index in tls_locals

  // The replicas' body (replica_body()): what a replica runs around the step's function (its context, device
  // and, on a GPU, stream: run_body), the one body of MirroredExtended's replicas; and the run's part of it
  // (reset()'s `body`), dropped with the run's function.
  PyObject* entry_type = nullptr;          // the context stack's entry type (context._Context, a tuple)
  PyObject* body_locals[4][2] = {};        // (local, name): the context stack, the md device, the name scope, the
                                           // running scope
  std::vector<PyObject*> body_scopes;      // each replica's _GpuReplicaScope (None: a CPU replica)
  std::vector<PyObject*> body_devices;     // its md device
  std::vector<PyObject*> body_streams;     // a GPU replica's own stream, ordinal (an int), and what save_gpu()
  std::vector<PyObject*> body_ordinals;    // returns when it parks with that stream on the stack (None each for
  std::vector<PyObject*> body_kept;        // a CPU replica)
  PyObject* gpu_module = nullptr;          // device/gpu.py (its `_step`: the md.function step under way), or null
  PyObject* out_of_memory = nullptr;       // gpu.raise_if_out_of_memory
  PyObject* step_streams = nullptr;        // (scope, step) -> (stream, memory, origin) inside md.function
  PyObject* run_body = nullptr;            // this run's (fn, column, arguments, strategy, contexts, name scope)

  // The cooperative scheduler (set once by cooperate(); hub set per run by reset()).
  PyObject* body = nullptr;           // the greenlets' run function (serve_replicas, bound to nothing)
  PyObject* greenlet_type = nullptr;
  PyObject* getcurrent = nullptr;
  PyObject* switch_fn = nullptr;      // greenlet.greenlet.switch
  PyObject* hub = nullptr;            // the run's caller's greenlet; null: this run is not cooperative
  PyObject* idle = nullptr;           // the hub's thread's idle greenlets (a list)
  PyObject* replicas = nullptr;       // the run's greenlet replicas (a set)
  std::vector<PyObject*> parked;      // greenlet replicas waiting in the collective under way
  std::deque<PyObject*> ready;        // greenlet replicas a combine (or an abort) released, resumed last first
  // The _GpuReplicaScopes of the replicas parked on the hub's thread whose stream stayed on the thread's
  // CuPy `with` stack (save_gpu), in the stack's order (owned). Resumed last first, each finds its stream
  // on top again, as nested `with` blocks unwind; one resumed out of that order takes the entries above
  // its own off first (restore_gpu).
  std::vector<PyObject*> stacked;
  int unfinished = 0;                 // greenlet replicas started and not returned

  int sleepers = 0;  // replicas on threads of their own waiting in sleep()
  std::mutex mu;
  std::condition_variable cv;
  unsigned long wakes = 0;  // (written under mu with the GIL held, so reads with the GIL held are exact)
};

struct Rendezvous {
  PyObject_HEAD
  State* s;
};

PyObject* str_combine;  // interned "combine", "parent", ...
PyObject* str_step;
PyObject* str_device_id;
PyObject* str_ptr;
PyObject* str_arrived;
PyObject* str_foreign;
PyObject* str_any_foreign;
PyObject* str_arrival_parts;
PyObject* str_parent;
PyObject* str_scope;
PyObject* str_entry;
PyObject* str_ordinal;
PyObject* str_enter;
PyObject* str_exit;
PyObject* str_use;
PyObject* str_dict;
PyObject* str_pending;
PyObject* str_finish;
PyObject* str_stream;
PyObject* str_device;
PyObject* str_require_current;
PyObject* str_record;
PyObject* str_wait_event;

PyTypeObject* rendezvous_type;  // (set by add_rendezvous)

bool settled(const State* s, long generation) { return s->generation != generation || s->broken != nullptr; }

// Wakes every waiting replica: threads through the condition, parked greenlets become ready.
void notify(State* s) {
  if (s->sleepers) {
    {
      std::lock_guard<std::mutex> lock(s->mu);
      ++s->wakes;
    }
    s->cv.notify_all();
  }
  if (s->hub) {
    for (PyObject* g : s->parked) s->ready.push_back(g);  // (the references move)
    s->parked.clear();
  }
}

// Waits for the next notify(), the GIL released; -1 with the error set if a signal handler raised
// (Ctrl-C in the main thread), checked every 50 ms.
int sleep(State* s) {
  const unsigned long epoch = s->wakes;
  ++s->sleepers;
  int rc = 0;
  for (;;) {
    bool woken;
    Py_BEGIN_ALLOW_THREADS
    {  // (mu is released before the GIL is taken back: notify() takes mu with the GIL held)
      std::unique_lock<std::mutex> lock(s->mu);
      woken = s->cv.wait_for(lock, std::chrono::milliseconds(50), [&] { return s->wakes != epoch; });
    }
    Py_END_ALLOW_THREADS
    if (woken) break;
    if (PyErr_CheckSignals() < 0) {
      rc = -1;
      break;
    }
  }
  --s->sleepers;
  return rc;
}

void break_group(State* s, PyObject* exc) {  // steals exc
  Py_XSETREF(s->broken, exc);
  notify(s);
}

// Breaks the group with an _Aborted, unless it is broken already, and wakes every waiter: the replicas
// waiting in a collective for one that failed (or for a run that was interrupted) are released. -1 only if
// the exception could not be made (the waiters are woken all the same).
int abort_group(State* s) {
  PyObject* exc = s->broken ? nullptr : PyObject_CallNoArgs(s->aborted_type);
  if (!exc) {
    notify(s);
    return s->broken ? 0 : -1;
  }
  break_group(s, exc);
  return 0;
}

// A replica returned while others wait in a collective it never called: they are stranded.
int check_stranded(State* s) {
  if (!s->arrived || s->arrived + s->finished != s->n || s->broken) return 0;
  PyObject* waiting = PyList_New(0);
  if (!waiting) return -1;
  PyObject* kind = nullptr;
  for (int i = 0; i < s->n; ++i) {
    if (s->kinds[i] && s->slots[i]) {
      PyObject* index = PyLong_FromLong(i);
      if (!index || PyList_Append(waiting, index) < 0) {
        Py_XDECREF(index);
        Py_DECREF(waiting);
        return -1;
      }
      Py_DECREF(index);
      if (!kind) kind = s->kinds[i];
    }
  }
  PyObject* exc = PyObject_CallFunction(
      PyExc_RuntimeError, "N",
      PyUnicode_FromFormat("replica(s) %R wait in %S but the other replicas returned without calling it; "
                           "every replica must make the same collective calls",
                           waiting, kind ? kind : Py_None));
  Py_DECREF(waiting);
  if (!exc) return -1;
  break_group(s, exc);
  return 0;
}

// The exception being raised, taken out of the error indicator (for every replica to raise).
PyObject* take_error() {
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  PyErr_NormalizeException(&type, &value, &traceback);
  if (traceback && value) PyException_SetTraceback(value, traceback);
  Py_XDECREF(type);
  Py_XDECREF(traceback);
  return value;
}

PyObject* module_global(PyObject* module, PyObject* name);

// combine(slots), through the GPU replicas' order when there is one (`arrival`: what note_arrival() returned
// to the combining replica, or null). A (first, combine) pair: first(slots) before the order, when no replica
// arrived on a stream of the user's (order._any_foreign) and no md.function step is under way; combine(slots)
// in the order when first returned None (a replica context's repeated all_reduce: _ReplicaAllReduce._first).
PyObject* run_combine(State* s, PyObject* combine, PyObject* slots, PyObject* arrival) {
  if (PyTuple_CheckExact(combine) && PyTuple_GET_SIZE(combine) == 2) {
    PyObject* first = PyTuple_GET_ITEM(combine, 0);
    combine = PyTuple_GET_ITEM(combine, 1);
    if (s->order) {
      PyObject* foreign = PyObject_GetAttr(s->order, str_any_foreign);
      const int any = foreign ? PyObject_IsTrue(foreign) : -1;
      Py_XDECREF(foreign);
      PyObject* step = any == 0 ? module_global(PyTuple_GET_ITEM(s->arrival_parts, 3), str_step) : nullptr;
      if (any < 0 || (any == 0 && !step)) return nullptr;
      Py_XDECREF(step);  // (compared by identity only)
      if (step == Py_None) {
        PyObject* results = PyObject_CallOneArg(first, slots);
        if (results != Py_None) return results;  // (or null with its error)
        Py_DECREF(results);
      }
    }
  }
  if (s->order)
    return PyObject_CallMethodObjArgs(s->order, str_combine, combine, slots, arrival ? arrival : Py_None, nullptr);
  return PyObject_CallOneArg(combine, slots);
}

// The last replica to arrive: one combine for all. Returns a new reference to its results, or to the
// exception it raised (every replica raises it; the run reports it once).
PyObject* combine_all(State* s, PyObject* combine, PyObject* arrival) {
  PyObject* results = nullptr;
  bool same = true;
  for (int i = 1; i < s->n && same; ++i) {
    int eq = s->kinds[i] == s->kinds[0] ? 1 : PyObject_RichCompareBool(s->kinds[i], s->kinds[0], Py_EQ);
    if (eq < 0) results = take_error();
    same = eq == 1;
  }
  if (!same && !results) {
    PyObject* calls = PyDict_New();
    for (int i = 0; calls && i < s->n; ++i) {
      PyObject* index = PyLong_FromLong(i);
      if (!index || PyDict_SetItem(calls, index, s->kinds[i]) < 0) Py_CLEAR(calls);
      Py_XDECREF(index);
    }
    results = calls ? PyObject_CallFunction(
                          PyExc_RuntimeError, "N",
                          PyUnicode_FromFormat("replicas made different collective calls at the same step: %R; "
                                               "every replica must call the same collectives in the same order",
                                               calls))
                    : nullptr;
    Py_XDECREF(calls);
    if (!results) results = take_error();
  } else if (same) {
    PyObject* slots = PyList_New(s->n);
    if (slots) {
      for (int i = 0; i < s->n; ++i) {
        Py_INCREF(s->slots[i]);
        PyList_SET_ITEM(slots, i, s->slots[i]);
      }
      results = run_combine(s, combine, slots, arrival);
      Py_DECREF(slots);
    }
    if (!results) results = take_error();
  }
  if (!results) {  // (a failure that set no error: cannot happen, but every replica must be told)
    results = PyObject_CallFunction(PyExc_SystemError, "s", "the combine of a collective failed without an error");
    if (!results) results = take_error();
    if (!results) results = Py_NewRef(Py_None);
  }
  Py_INCREF(results);
  Py_XSETREF(s->results, results);
  for (PyObject*& slot : s->slots) Py_CLEAR(slot);
  s->arrived = 0;
  ++s->generation;
  notify(s);
  return results;
}

PyObject* switch_to(State* s, PyObject* g, PyObject* a = nullptr, PyObject* b = nullptr) {
  PyObject* args[3] = {g, a, b};
  return PyObject_Vectorcall(s->switch_fn, args, a ? 3 : 1, nullptr);
}

// The index of the next replica the caller runs itself (a new reference), None once the threads have
// claimed or the caller has run every replica, or null with an error. Once the step has run longer than
// `handoff` seconds, wake() is asked whether it is long (then the threads take the replicas not started yet).
PyObject* claim(State* s) {
  while (s->next < s->n) {
    // (Asked before the index is taken: a wake() that raises, as Ctrl-C may make it, loses no replica.)
    if (!s->woken && s->wake &&
        std::chrono::duration<double>(std::chrono::steady_clock::now() - s->started).count() > s->handoff) {
      PyObject* woken = PyObject_CallNoArgs(s->wake);
      if (!woken) return nullptr;
      const int truth = PyObject_IsTrue(woken);
      Py_DECREF(woken);
      if (truth < 0) return nullptr;
      s->woken = truth;
    }
    const int i = s->next++;
    PyObject* index = PyLong_FromLong(i);
    if (!index || !s->claims) return index;
    PyObject* owner = PyDict_SetDefault(s->claims, index, s->mine);  // (borrowed)
    if (owner == s->mine) return index;
    Py_DECREF(index);
    if (!owner) return nullptr;
  }
  Py_RETURN_NONE;
}

// Replica i (1..n-1) is done with this run; the last of them tells the pool: on the caller's thread by
// `completed` (the caller reads it once the run ends), on a thread of its own by complete().
int arrive(State* s, long i, bool caller) {
  if (i < 1 || i >= s->n) {
    PyErr_Format(PyExc_ValueError, "arrive(%ld): expected a replica index in [1, %d)", i, s->n);
    return -1;
  }
  if (s->arrived_flags && PyList_SetItem(s->arrived_flags, i, Py_NewRef(Py_True)) < 0) return -1;
  if (++s->arrivals != s->n - 1) return 0;
  if (caller || !s->complete) {
    s->completed = true;
    return 0;
  }
  PyObject* r = PyObject_CallNoArgs(s->complete);
  Py_XDECREF(r);
  return r ? 0 : -1;
}

// Runs replica `index` as a greenlet until it returns or parks, on an idle greenlet of this thread if
// there is one (a new greenlet costs ~20 us, its own frame stack; a switch ~0.4 us).
int start(State* s, PyObject* self, PyObject* index) {
  PyObject* g;
  Py_ssize_t idle = PyList_GET_SIZE(s->idle);
  if (idle) {
    g = PyList_GET_ITEM(s->idle, idle - 1);
    Py_INCREF(g);
    if (PyList_SetSlice(s->idle, idle - 1, idle, nullptr) < 0) {
      Py_DECREF(g);
      return -1;
    }
  } else {
    g = PyObject_CallOneArg(s->greenlet_type, s->body);
    if (!g) return -1;
  }
  if (PyObject_SetAttr(g, str_parent, s->hub) < 0 || PySet_Add(s->replicas, g) < 0) {
    Py_DECREF(g);
    return -1;
  }
  ++s->unfinished;
  PyObject* r = switch_to(s, g, self, index);
  Py_DECREF(g);
  Py_XDECREF(r);
  return r ? 0 : -1;
}

int switch_ready(State* s) {  // resumes the latest ready replica (see `stacked`)
  PyObject* g = s->ready.back();
  s->ready.pop_back();
  PyObject* r = switch_to(s, g);
  Py_DECREF(g);
  Py_XDECREF(r);
  return r ? 0 : -1;
}

// The hub's replica waits in the collective of `generation`: start and resume the other replicas until it
// settles, sleeping only while they all wait for replicas on other threads.
int serve(State* s, PyObject* self, long generation) {
  while (!settled(s, generation)) {
    if (!s->ready.empty()) {
      if (switch_ready(s) < 0) return -1;
      continue;
    }
    PyObject* index = claim(s);
    if (!index) return -1;
    if (index != Py_None) {
      int rc = start(s, self, index);
      Py_DECREF(index);
      if (rc < 0) return -1;
      continue;
    }
    Py_DECREF(index);
    if (!settled(s, generation) && s->ready.empty() && sleep(s) < 0) return -1;
  }
  return 0;
}

// The tracked locals' dicts on this thread (tls_dicts' data) when the cache holds this thread's, else null:
// access them as attributes. A local's dict is then `dicts[k]` for its index k in tls_locals (-1: untracked).
PyObject* const* thread_dicts(const State* s) {
  return s->tls_thread && PyThreadState_GetID(PyThreadState_Get()) == s->tls_thread ? s->tls_dicts.data() : nullptr;
}

// local.name as a new reference (`missing` when unset), or null with an error; `k`: the local's index (above).
PyObject* get_local(PyObject* const* dicts, int k, PyObject* local, PyObject* name, PyObject* missing) {
  if (PyObject* dict = dicts && k >= 0 ? dicts[k] : nullptr) {
    PyObject* value = PyDict_GetItemWithError(dict, name);
    if (value) return Py_NewRef(value);
    return PyErr_Occurred() ? nullptr : Py_NewRef(missing);
  }
  PyObject* value = PyObject_GetAttr(local, name);
  if (!value && PyErr_ExceptionMatches(PyExc_AttributeError)) {
    PyErr_Clear();
    value = Py_NewRef(missing);
  }
  return value;
}

int set_local(PyObject* const* dicts, int k, PyObject* local, PyObject* name, PyObject* value) {
  PyObject* dict = dicts && k >= 0 ? dicts[k] : nullptr;
  return dict ? PyDict_SetItem(dict, name, value) : PyObject_SetAttr(local, name, value);
}

// The locals whose dicts may be cached (after cooperate() or replica_body() changed them): plain threading.locals
// (not a subclass, nor another library's local: gevent's is per greenlet), none of whose names used here is an
// attribute of its type (which `local.name` would find first). The cache is looked up again at the next reset().
int track_locals(State* s) {
  std::vector<std::pair<PyObject*, PyObject*>> pairs;  // (local, name), borrowed
  for (size_t i = 0; i + 2 < s->state_locals.size(); i += 3) pairs.emplace_back(s->state_locals[i], s->state_locals[i + 1]);
  if (s->running) pairs.emplace_back(s->running, str_scope);
  for (auto& local : s->body_locals)
    if (local[0]) pairs.emplace_back(local[0], local[1]);
  if (s->stack_local[0]) pairs.emplace_back(s->stack_local[0], s->stack_local[1]);
  PyObject* module = PyImport_ImportModule("_thread");
  PyObject* plain = module ? PyObject_GetAttrString(module, "_local") : nullptr;
  Py_XDECREF(module);
  if (!plain) return -1;
  std::vector<PyObject*> locals;
  for (auto [local, name] : pairs) {
    if (std::find(locals.begin(), locals.end(), local) != locals.end()) continue;
    bool ok = Py_TYPE(local) == reinterpret_cast<PyTypeObject*>(plain);
    for (auto [other, other_name] : pairs)
      if (ok && other == local) {
        PyObject* found = PyObject_GetAttr(reinterpret_cast<PyObject*>(Py_TYPE(local)), other_name);
        Py_XDECREF(found);
        if (!found && !PyErr_ExceptionMatches(PyExc_AttributeError)) {
          Py_DECREF(plain);
          return -1;
        }
        PyErr_Clear();
        ok = !found;
      }
    if (ok) locals.push_back(local);
  }
  Py_DECREF(plain);
  for (PyObject* o : s->tls_locals) Py_DECREF(o);
  for (PyObject* o : s->tls_dicts) Py_XDECREF(o);
  s->tls_locals.clear();
  s->tls_dicts.assign(locals.size(), nullptr);
  for (PyObject* o : locals) s->tls_locals.push_back(Py_NewRef(o));
  s->tls_thread = 0;
  auto index = [&](PyObject* local) {
    auto it = std::find(locals.begin(), locals.end(), local);
    return it == locals.end() ? -1 : static_cast<int>(it - locals.begin());
  };
  s->state_tls.clear();
  for (size_t i = 0; i + 2 < s->state_locals.size(); i += 3) s->state_tls.push_back(index(s->state_locals[i]));
  s->running_tls = s->running ? index(s->running) : -1;
  for (int k = 0; k < 4; ++k) s->body_tls[k] = s->body_locals[k][0] ? index(s->body_locals[k][0]) : -1;
  s->stack_tls = s->stack_local[0] ? index(s->stack_local[0]) : -1;
  return 0;
}

// Looks the tracked locals' dicts up for this thread (the run's caller), unless they are this thread's already.
int cache_thread_dicts(State* s) {
  if (s->tls_locals.empty()) return 0;
  const uint64_t thread = PyThreadState_GetID(PyThreadState_Get());
  if (thread == s->tls_thread) return 0;
  s->tls_thread = 0;
  for (size_t k = 0; k < s->tls_locals.size(); ++k) {
    PyObject* dict = PyObject_GetAttr(s->tls_locals[k], str_dict);
    if (!dict) return -1;
    if (!PyDict_CheckExact(dict)) Py_CLEAR(dict);
    Py_XSETREF(s->tls_dicts[k], dict);
  }
  s->tls_thread = thread;
  return 0;
}

// The stream of a _GpuReplicaScope that is entered, a new reference (null with an error): its `_entry[0]` inside
// md.function (the step's stream, or a fork of it), else the scope's own stream, which the body enters without
// writing `_entry` (a slot write each way, per replica and step).
PyObject* scope_stream(State* s, PyObject* scope) {
  PyObject* entry = PyObject_GetAttr(scope, str_entry);
  if (!entry) return nullptr;
  if (entry != Py_None) {
    PyObject* stream = PySequence_GetItem(entry, 0);
    Py_DECREF(entry);
    return stream;
  }
  Py_DECREF(entry);
  for (size_t i = 0; i < s->body_scopes.size(); ++i)
    if (s->body_scopes[i] == scope) return Py_NewRef(s->body_streams[i]);
  PyErr_SetString(PyExc_RuntimeError, "a GPU replica's scope is running but was not entered (its _entry is None)");
  return nullptr;
}

// GPU replicas' CUDA state (_GpuThreadState): the current CUDA device, the current stream of each of the
// strategy's GPUs and the running replica's _GpuReplicaScope, whose stream comes off the thread's `with`
// stack (CuPy's, per thread) while another replica runs.
//
// `arrival`: what MergeOrder.arrive returned for this replica just before it parks (nothing has run since):
// the current device's current stream, or None. When that is the scope's own stream and the strategy has
// one GPU, it says all there is to save without asking CuPy: the current device is that stream's (CuPy
// keeps a stream current only in its own device's slot: cupy/cuda/stream.pyx _ThreadLocal.current_stream),
// and the GPU's current stream is that stream. The stream then stays on the `with` stack (see `stacked`):
// what runs before the replica resumes pushes above it and pops back to it.
//
// Returns (device, streams, scope, whether the stream stayed on the stack).
PyObject* save_gpu(State* s, PyObject* arrival) {
  // (None: no GPU replica has run on this thread yet)
  PyObject* scope = get_local(thread_dicts(s), s->running_tls, s->running, str_scope, Py_None);
  if (!scope) return nullptr;
  if (arrival && arrival != Py_None && PyTuple_GET_SIZE(s->ordinals) == 1) {
    // A GPU replica parked on its own stream (outside md.function: inside, arrivals note no stream): its saved
    // state was made once (replica_body).
    for (size_t i = 0; i < s->body_scopes.size(); ++i)
      if (s->body_scopes[i] == scope && s->body_streams[i] == arrival) {
        s->stacked.push_back(scope);  // (the reference moves)
        return Py_NewRef(s->body_kept[i]);
      }
  }
  PyObject* stream = nullptr;  // the scope's stream (a new reference), or null: no scope
  if (scope != Py_None) {
    stream = scope_stream(s, scope);
    if (!stream) {
      Py_DECREF(scope);
      return nullptr;
    }
  }
  const Py_ssize_t count = PyTuple_GET_SIZE(s->ordinals);
  PyObject *device = nullptr, *streams = nullptr;
  const bool kept = stream && arrival == stream && count == 1;
  if (kept) {
    device = PyObject_GetAttr(scope, str_ordinal);
    streams = device ? PyTuple_Pack(1, stream) : nullptr;
  } else {
    device = PyObject_CallNoArgs(s->get_device);
    streams = device ? PyTuple_New(count) : nullptr;
    for (Py_ssize_t k = 0; streams && k < count; ++k) {
      PyObject* current = PyObject_CallOneArg(s->current_stream, PyTuple_GET_ITEM(s->ordinals, k));
      if (!current) Py_CLEAR(streams);
      else PyTuple_SET_ITEM(streams, k, current);
    }
  }
  PyObject* saved = streams ? PyTuple_Pack(4, device, streams, scope, kept ? Py_True : Py_False) : nullptr;
  if (saved && kept) {
    s->stacked.push_back(Py_NewRef(scope));
  } else if (saved && stream) {  // its stream off the thread's `with` stack
    PyObject* r = PyObject_CallMethodObjArgs(stream, str_exit, Py_None, Py_None, Py_None, nullptr);
    if (!r) Py_CLEAR(saved);
    Py_XDECREF(r);
  }
  Py_XDECREF(stream);
  Py_XDECREF(streams);
  Py_XDECREF(device);
  Py_DECREF(scope);
  return saved;
}

int set_device(State* s, PyObject* ordinal) {
  PyObject* r = PyObject_CallOneArg(s->set_device, ordinal);
  Py_XDECREF(r);
  return r ? 0 : -1;
}

// The current device as a long, or -1 with an error set.
long current_device(State* s) {
  PyObject* device = PyObject_CallNoArgs(s->get_device);
  if (!device) return -1;
  const long on = PyLong_AsLong(device);
  Py_DECREF(device);
  return on;
}


// A replica whose stream save_gpu() left on the `with` stack resumes: its GPU current again, and its stream
// on top: so it is unless replicas parked after it are still parked (it resumes out of the stack's order),
// whose entries then come off (they go back on when those resume); an entry taken off so earlier goes back
// on. Popped with the GPU current: a pop makes the entry below current on its stream's device, or, for the
// legacy stream below everything, on the current device (cupy/cuda/stream.pyx _ThreadLocal.pop_stream).
int restore_kept(State* s, PyObject* scope, PyObject* ordinal) {
  const long on = PyLong_AsLong(ordinal);
  const long now = on == -1 && PyErr_Occurred() ? -1 : current_device(s);
  if ((now == -1 && PyErr_Occurred()) || (now != on && set_device(s, ordinal) < 0)) return -1;
  auto it = std::find(s->stacked.begin(), s->stacked.end(), scope);
  if (it == s->stacked.end()) {  // taken off by a resume out of order: back on top
    PyObject* stream = scope_stream(s, scope);
    PyObject* r = stream ? PyObject_CallMethodNoArgs(stream, str_enter) : nullptr;
    Py_XDECREF(stream);
    Py_XDECREF(r);
    return r ? 0 : -1;
  }
  while (s->stacked.back() != scope) {  // (moved out before the call: it may reach this state again)
    PyObject* above = s->stacked.back();
    s->stacked.pop_back();
    PyObject* stream = scope_stream(s, above);
    PyObject* r = stream ? PyObject_CallMethodObjArgs(stream, str_exit, Py_None, Py_None, Py_None, nullptr) : nullptr;
    Py_XDECREF(stream);
    Py_DECREF(above);
    if (!r) return -1;
    Py_DECREF(r);
  }
  s->stacked.pop_back();
  Py_DECREF(scope);  // (the reference `stacked` held; the saved state holds another)
  return 0;
}

// Puts back what save_gpu() read: the scope's GPU current and its stream on top of the `with` stack again,
// then each GPU's current stream and the current device. Only what differs is set: replicas mostly share
// a GPU and keep their stream.
int restore_gpu(State* s, PyObject* saved) {
  if (!PyTuple_Check(saved) || PyTuple_GET_SIZE(saved) != 4 || !PyTuple_Check(PyTuple_GET_ITEM(saved, 1)) ||
      PyTuple_GET_SIZE(PyTuple_GET_ITEM(saved, 1)) != PyTuple_GET_SIZE(s->ordinals)) {
    PyErr_SetString(PyExc_TypeError, "restore_state(saved): expected what save_state() returned");
    return -1;
  }
  PyObject *device = PyTuple_GET_ITEM(saved, 0), *streams = PyTuple_GET_ITEM(saved, 1),
           *scope = PyTuple_GET_ITEM(saved, 2);
  if (set_local(thread_dicts(s), s->running_tls, s->running, str_scope, scope) < 0) return -1;
  if (PyTuple_GET_ITEM(saved, 3) == Py_True) return restore_kept(s, scope, device);  // (all it saved is that stream's)
  PyObject* entered = nullptr;  // (the stream just made current on GPU `on`: its current stream needs no lookup)
  long on;
  if (scope != Py_None) {
    PyObject* ordinal = PyObject_GetAttr(scope, str_ordinal);
    if (!ordinal) return -1;
    on = PyLong_AsLong(ordinal);
    long now = on == -1 && PyErr_Occurred() ? -1 : current_device(s);
    int rc = now == -1 && PyErr_Occurred() ? -1 : now != on ? set_device(s, ordinal) : 0;
    Py_DECREF(ordinal);
    if (rc < 0) return -1;
    entered = scope_stream(s, scope);
    PyObject* r = entered ? PyObject_CallMethodNoArgs(entered, str_enter) : nullptr;
    if (!r) {
      Py_XDECREF(entered);
      return -1;
    }
    Py_DECREF(r);
  } else {
    on = current_device(s);
    if (on == -1 && PyErr_Occurred()) return -1;
  }
  const long entered_on = on;
  int rc = 0;
  for (Py_ssize_t k = 0; rc == 0 && k < PyTuple_GET_SIZE(s->ordinals); ++k) {
    PyObject *ordinal = PyTuple_GET_ITEM(s->ordinals, k), *stream = PyTuple_GET_ITEM(streams, k);
    const long o = PyLong_AsLong(ordinal);
    if (o == -1 && PyErr_Occurred()) {
      rc = -1;
      break;
    }
    PyObject* current = entered && o == entered_on ? Py_NewRef(entered) : PyObject_CallOneArg(s->current_stream, ordinal);
    if (!current) {
      rc = -1;
      break;
    }
    Py_DECREF(current);  // (compared by identity only)
    if (current == stream) continue;
    if (on != o) {  // (Stream.use sets the stream of the current device)
      if (set_device(s, ordinal) < 0) {
        rc = -1;
        break;
      }
      on = o;
    }
    PyObject* r = PyObject_CallMethodNoArgs(stream, str_use);
    Py_XDECREF(r);
    if (!r) rc = -1;
  }
  Py_XDECREF(entered);
  if (rc < 0) return -1;
  const long want = PyLong_AsLong(device);
  if (want == -1 && PyErr_Occurred()) return -1;
  return on != want ? set_device(s, device) : 0;
}

// The thread's state (the thread-locals, and GPU replicas' CUDA state last) as a tuple; `arrival`: see
// save_gpu (null: none).
PyObject* save_state(State* s, PyObject* arrival = nullptr) {
  const Py_ssize_t count = static_cast<Py_ssize_t>(s->state_locals.size() / 3);
  PyObject* saved = PyTuple_New(count + (s->running ? 1 : 0));
  PyObject* const* dicts = thread_dicts(s);
  for (Py_ssize_t i = 0; saved && i < count; ++i) {
    PyObject* value = get_local(dicts, s->state_tls[i], s->state_locals[3 * i], s->state_locals[3 * i + 1],
                                s->state_locals[3 * i + 2]);
    if (!value) Py_CLEAR(saved);
    else PyTuple_SET_ITEM(saved, i, value);
  }
  if (saved && s->running) {
    PyObject* gpu = save_gpu(s, arrival);
    if (!gpu) Py_CLEAR(saved);
    else PyTuple_SET_ITEM(saved, count, gpu);
  }
  return saved;
}

int restore_state(State* s, PyObject* saved) {
  const Py_ssize_t count = static_cast<Py_ssize_t>(s->state_locals.size() / 3);
  if (!PyTuple_Check(saved) || PyTuple_GET_SIZE(saved) != count + (s->running ? 1 : 0)) {
    PyErr_SetString(PyExc_TypeError, "restore_state(saved): expected what save_state() returned");
    return -1;
  }
  PyObject* const* dicts = thread_dicts(s);
  for (Py_ssize_t i = 0; i < count; ++i)
    if (set_local(dicts, s->state_tls[i], s->state_locals[3 * i], s->state_locals[3 * i + 1], PyTuple_GET_ITEM(saved, i)) < 0)
      return -1;
  return s->running ? restore_gpu(s, PyTuple_GET_ITEM(saved, count)) : 0;
}

// Takes every entry of `me` out of `queue` (the references move to `dropped`).
template <typename Queue>
void take_out(Queue& queue, PyObject* me, std::vector<PyObject*>& dropped) {
  for (auto it = queue.begin(); it != queue.end();) {
    if (*it == me) {
      dropped.push_back(*it);
      it = queue.erase(it);
    } else {
      ++it;
    }
  }
}

// A greenlet replica whose wait failed leaves the collective: a later combine or abort must not
// resume it where it no longer waits (in retire, say, whose switch would then return nothing).
void unpark(State* s, PyObject* me) {
  std::vector<PyObject*> dropped;
  take_out(s->parked, me, dropped);
  take_out(s->ready, me, dropped);
  for (PyObject* g : dropped) Py_DECREF(g);
}

// The results of the collective of `generation` for the running replica, the hub or a greenlet (parked
// already): the hub serves the others; a greenlet hands the thread on, to the next replica not started yet
// (started from here: a round trip through the hub saved), else to the hub, until a combine (or an abort)
// makes it ready and someone resumes it. Its thread-local state goes and comes back with it (`arrival`: see
// save_gpu).
PyObject* wait(State* s, PyObject* self, long generation, PyObject* me, Waiter waiter, PyObject* arrival) {
  PyObject* saved = save_state(s, arrival);
  if (!saved) return nullptr;
  PyObject* results = nullptr;
  for (;;) {
    if (waiter == kHub) {
      if (serve(s, self, generation) < 0) break;
    } else {
      PyObject* index = claim(s);
      if (!index) break;
      int rc;
      if (index != Py_None) {
        rc = start(s, self, index);
      } else if (!s->ready.empty()) {  // (as retire() does: the hub would only pass the thread on to it)
        rc = switch_ready(s);
      } else {
        PyObject* r = switch_to(s, s->hub);
        Py_XDECREF(r);
        rc = r ? 0 : -1;
      }
      Py_DECREF(index);
      if (rc < 0) break;
    }
    if (s->generation != generation) {
      results = s->results;
      Py_INCREF(results);
      break;
    }
    if (s->broken) {
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(s->broken)), s->broken);
      break;
    }
    if (waiter == kGreenlet) {
      Py_INCREF(me);
      s->parked.push_back(me);
    }
  }
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);  // (restored whatever happened, the error kept)
  if (!results && waiter == kGreenlet) unpark(s, me);
  const int rc = restore_state(s, saved);
  Py_DECREF(saved);
  if (type) {
    if (rc < 0) PyErr_Clear();
    PyErr_Restore(type, value, traceback);
  } else if (rc < 0) {
    Py_CLEAR(results);
  }
  return results;
}

PyObject* raise_broken(State* s) {
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(s->broken)), s->broken);
  return nullptr;
}

// A module's global `name` as a new reference, read from the module's dict (no attribute lookup: every replica
// asks for device/gpu.py's `_step`, the md.function step under way or None, and the timeline's `_trace`).
PyObject* module_global(PyObject* module, PyObject* name) {
  if (!PyModule_CheckExact(module)) return PyObject_GetAttr(module, name);
  PyObject* step = PyDict_GetItemWithError(PyModule_GetDict(module), name);
  if (step) return Py_NewRef(step);
  return PyErr_Occurred() ? nullptr : PyObject_GetAttr(module, name);  // (raises the AttributeError)
}

// GPU replica `rid` arrives at a collective (MergeOrder's part, done here: no Python frame a replica): the
// stream it queued its inputs on is noted (order._arrived[rid]; also order._foreign[rid] when that is not
// a replica stream nor the legacy one, which the combine orders with events). Returns a new reference to
// that stream when it is the current device's current stream (see save_gpu), else to None; null with an
// error. Replicas of no GPU, and every replica inside md.function (device/gpu.py `_step`), note nothing.
PyObject* note_arrival(State* s, long rid) {
  PyObject *ordinals = PyTuple_GET_ITEM(s->arrival_parts, 0), *current = PyTuple_GET_ITEM(s->arrival_parts, 1),
           *ours = PyTuple_GET_ITEM(s->arrival_parts, 2), *module = PyTuple_GET_ITEM(s->arrival_parts, 3);
  PyObject* ordinal = rid < PyTuple_GET_SIZE(ordinals) ? PyTuple_GET_ITEM(ordinals, rid) : Py_None;
  if (ordinal == Py_None) Py_RETURN_NONE;
  PyObject* step = module_global(module, str_step);
  if (!step) return nullptr;
  Py_DECREF(step);  // (compared by identity only)
  if (step != Py_None) Py_RETURN_NONE;
  // The current device's current stream: CuPy files a stream only under its own device, so when that is the
  // replica's GPU, the replica's GPU is current too; else (another device current, or the legacy stream,
  // whose device_id is -1) asked by ordinal.
  PyObject* stream = PyObject_CallNoArgs(current);
  // (The replica's own stream, which the body entered, is on its GPU and a replica stream: nothing to ask.)
  const bool own = stream && static_cast<size_t>(rid) < s->body_streams.size() && stream == s->body_streams[rid];
  PyObject* device = stream && !own ? PyObject_GetAttr(stream, str_device_id) : nullptr;
  const int here = own ? 1 : device ? PyObject_RichCompareBool(device, ordinal, Py_EQ) : -1;
  Py_XDECREF(device);
  if (here == 0) Py_SETREF(stream, PyObject_CallOneArg(current, ordinal));
  if (here < 0 || !stream) {
    Py_XDECREF(stream);
    return nullptr;
  }
  PyObject* arrived = PyObject_GetAttr(s->order, str_arrived);
  int rc = arrived ? PySequence_SetItem(arrived, rid, stream) : -1;
  Py_XDECREF(arrived);
  PyObject* ptr = rc == 0 && !own ? PyObject_GetAttr(stream, str_ptr) : nullptr;
  int foreign = own ? (rc == 0 ? 0 : -1) : ptr ? PyObject_IsTrue(ptr) : -1;
  if (foreign == 1) foreign = PySet_Contains(ours, ptr) == 0 ? 1 : PyErr_Occurred() ? -1 : 0;
  Py_XDECREF(ptr);
  if (foreign == 1) {
    PyObject* slots = PyObject_GetAttr(s->order, str_foreign);
    foreign = slots && PySequence_SetItem(slots, rid, stream) == 0 &&
                      PyObject_SetAttr(s->order, str_any_foreign, Py_True) == 0 ? 0 : -1;
    Py_XDECREF(slots);
  }
  if (foreign < 0) {
    Py_DECREF(stream);
    return nullptr;
  }
  if (here) return stream;
  Py_DECREF(stream);
  Py_RETURN_NONE;
}

PyObject* exchange_arrived(Rendezvous* self, State* s, long rid, PyObject* kind, PyObject* payload,
                           PyObject* combine, PyObject* arrival);

// Checks that the replica context `context` is the calling thread's (the top of its context stack, the
// Rendezvous' `stack`), as ReplicaContext._require_current does: natively when it is (a collective's common
// case), else by asking that method, which raises. 0, or -1 with its error.
int check_current(State* s, PyObject* context, PyObject* kind) {
  if (s->stack_local[0]) {
    PyObject* stack = get_local(thread_dicts(s), s->stack_tls, s->stack_local[0], s->stack_local[1], Py_None);
    if (!stack) return -1;
    const Py_ssize_t depth = PyList_Check(stack) ? PyList_GET_SIZE(stack) : 0;
    PyObject* top = depth ? PyList_GET_ITEM(stack, depth - 1) : nullptr;  // (a _Context: (strategy, replica context))
    const bool current = top && PyTuple_Check(top) && PyTuple_GET_SIZE(top) == 2 && PyTuple_GET_ITEM(top, 1) == context;
    Py_DECREF(stack);
    if (current) return 0;
  }
  PyObject* r = PyObject_CallMethodOneArg(context, str_require_current, kind);
  Py_XDECREF(r);
  return r ? 0 : -1;
}

// Replica `rid` hands in `payload` for the collective `kind`; returns its part of combine's results.
PyObject* exchange(Rendezvous* self, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4 && nargs != 5) {
    PyErr_Format(PyExc_TypeError, "exchange(rid, kind, payload, combine, context=None) takes 4 or 5 arguments (%zd "
                 "given)", nargs);
    return nullptr;
  }
  State* s = self->s;
  const long rid = PyLong_AsLong(args[0]);
  if (rid == -1 && PyErr_Occurred()) return nullptr;
  if (rid < 0 || rid >= s->n) {
    PyErr_Format(PyExc_ValueError, "rid=%ld: expected a replica index in [0, %d)", rid, s->n);
    return nullptr;
  }
  PyObject *kind = args[1], *payload = args[2], *combine = args[3];
  if (nargs == 5 && args[4] != Py_None && check_current(s, args[4], kind) < 0) return nullptr;
  PyObject* arrival = nullptr;  // what note_arrival() returned (see save_gpu)
  if (s->order) {
    arrival = note_arrival(s, rid);
    if (!arrival) return nullptr;
  }
  PyObject* results = exchange_arrived(self, s, rid, kind, payload, combine, arrival);
  Py_XDECREF(arrival);
  return results;
}

// exchange() once the replica has arrived at the order (`arrival`: what that returned, borrowed).
PyObject* exchange_arrived(Rendezvous* self, State* s, long rid, PyObject* kind, PyObject* payload,
                           PyObject* combine, PyObject* arrival) {
  PyObject* results = nullptr;
  if (s->n == 1) {
    PyObject* slots = PyList_New(1);
    if (!slots) return nullptr;
    Py_INCREF(payload);
    PyList_SET_ITEM(slots, 0, payload);
    results = run_combine(s, combine, slots, arrival);
    Py_DECREF(slots);
    if (!results) return nullptr;
  } else {
    // Who waits, found before the state is touched (the calls may run other threads).
    Waiter waiter = kThread;
    PyObject* me = nullptr;
    if (s->hub) {
      me = PyObject_CallNoArgs(s->getcurrent);
      if (!me) return nullptr;
      int member = me == s->hub ? 1 : PySet_Contains(s->replicas, me);
      if (member < 0) {
        Py_DECREF(me);
        return nullptr;
      }
      waiter = me == s->hub ? kHub : member ? kGreenlet : kThread;
    }
    if (s->broken) {
      Py_XDECREF(me);
      return raise_broken(s);
    }
    const long generation = s->generation;
    Py_INCREF(payload);
    Py_XSETREF(s->slots[rid], payload);
    Py_INCREF(kind);
    Py_XSETREF(s->kinds[rid], kind);
    if (++s->arrived == s->n) {
      results = combine_all(s, combine, arrival);
    } else if ((s->finished && check_stranded(s) < 0) || (waiter != kThread && s->broken)) {
      results = nullptr;  // (stranded: this replica is the one left waiting)
      if (!PyErr_Occurred()) raise_broken(s);
    } else if (waiter == kThread) {
      while (!settled(s, generation)) {
        if (sleep(s) < 0) break;
      }
      if (PyErr_Occurred()) results = nullptr;
      else if (s->generation == generation) raise_broken(s);
      else results = Py_NewRef(s->results);
    } else {
      if (waiter == kGreenlet) s->parked.push_back(Py_NewRef(me));
      results = wait(s, reinterpret_cast<PyObject*>(self), generation, me, waiter, arrival);
    }
    Py_XDECREF(me);
    if (!results) return nullptr;
  }
  PyObject* mine = nullptr;
  if (PyExceptionInstance_Check(results)) {
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(results)), results);
  } else {
    mine = PySequence_GetItem(results, rid);
  }
  Py_DECREF(results);
  return mine;
}

// Whether __init__ ran (it sets the callables the calls below make); a TypeError otherwise, as a subclass
// whose __init__ skips the base's, or Rendezvous.__new__ alone, leaves them null.
bool initialised(const State* s) {
  if (s->n > 0) return true;
  PyErr_SetString(PyExc_TypeError, "Rendezvous.__init__ was not called: make it with Rendezvous(n, aborted, tracing, "
                                   "traced) (a subclass's __init__ calls super().__init__)");
  return false;
}

PyObject* rv_exchange(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  State* s = reinterpret_cast<Rendezvous*>(self)->s;
  if (!initialised(s)) return nullptr;
  // (A module's global read from its dict: every replica's every collective asks.)
  PyObject* tracing = PyTuple_Check(s->tracing)
                          ? module_global(PyTuple_GET_ITEM(s->tracing, 0), PyTuple_GET_ITEM(s->tracing, 1))
                          : PyObject_CallNoArgs(s->tracing);
  if (!tracing) return nullptr;
  const int traced = PyObject_IsTrue(tracing);
  Py_DECREF(tracing);
  if (traced < 0) return nullptr;
  if (traced && (nargs == 4 || nargs == 5)) {  // the timeline records each replica's wait
    PyObject* call[6] = {self, args[0], args[1], args[2], args[3], nargs == 5 ? args[4] : nullptr};
    return PyObject_Vectorcall(s->traced, call, nargs + 1, nullptr);
  }
  return exchange(reinterpret_cast<Rendezvous*>(self), args, nargs);
}

PyObject* rv_exchange_untraced(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (!initialised(reinterpret_cast<Rendezvous*>(self)->s)) return nullptr;
  return exchange(reinterpret_cast<Rendezvous*>(self), args, nargs);
}

void clear_run(State* s) {
  for (PyObject*& slot : s->slots) Py_CLEAR(slot);
  for (PyObject*& kind : s->kinds) Py_CLEAR(kind);
  Py_CLEAR(s->results);
  Py_CLEAR(s->broken);
  s->arrived = s->finished = 0;
  s->generation = 0;
}

void clear_cooperative(State* s) {  // an interrupted run's greenlets, dropped
  // Moved out first: a dropped greenlet runs its replica on (GreenletExit), which may reach these queues.
  std::vector<PyObject*> dropped(s->parked.begin(), s->parked.end());
  dropped.insert(dropped.end(), s->ready.begin(), s->ready.end());
  s->parked.clear();
  s->ready.clear();
  s->unfinished = 0;
  for (PyObject* g : dropped) Py_DECREF(g);
  if (s->replicas) PySet_Clear(s->replicas);
}

void clear_pool_run(State* s) {
  Py_CLEAR(s->fn);
  Py_CLEAR(s->run_body);
  Py_CLEAR(s->outputs);
  Py_CLEAR(s->errors);
  Py_CLEAR(s->claims);
  Py_CLEAR(s->mine);
  Py_CLEAR(s->arrived_flags);
  s->next = s->n;  // (nothing to claim outside a run)
  s->arrivals = 0;
  s->completed = false;
  s->woken = true;
}

// Whether `body` is a run's part of the GPU replicas' body, as reset() takes it (see the method table).
bool valid_body(const State* s, PyObject* body) {
  auto per_replica = [&](PyObject* o) {
    return (PyList_Check(o) || PyTuple_Check(o)) && PySequence_Fast_GET_SIZE(o) == s->n;
  };
  return PyTuple_Check(body) && PyTuple_GET_SIZE(body) == 6 && s->entry_type &&
         (PyTuple_GET_ITEM(body, 1) == Py_None || per_replica(PyTuple_GET_ITEM(body, 1))) &&
         (PyTuple_GET_ITEM(body, 2) == Py_None || per_replica(PyTuple_GET_ITEM(body, 2))) &&
         per_replica(PyTuple_GET_ITEM(body, 4));
}

// reset(idle, fn=None, outputs=None, errors=None, claims=None, mine=None, arrived=None, woken=True, body=None):
// ready for a run (see the method table).
PyObject* rv_reset(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  State* s = reinterpret_cast<Rendezvous*>(self)->s;
  if (nargs < 1 || nargs > 9) {
    PyErr_Format(PyExc_TypeError, "reset(idle, fn=None, outputs=None, errors=None, claims=None, mine=None, "
                                  "arrived=None, woken=True, body=None) takes 1 to 9 arguments (%zd given)", nargs);
    return nullptr;
  }
  PyObject* body = nargs > 8 && args[8] != Py_None ? args[8] : nullptr;
  if (body && (!valid_body(s, body) || nargs < 2 || args[1] == Py_None)) {
    PyErr_Format(PyExc_TypeError, "reset(body=...): expected (fn, column, arguments, strategy, contexts, name_scope), "
                 "column and arguments None or %d items each, contexts %d, after replica_body(), with the run's fn",
                 s->n, s->n);
    return nullptr;
  }
  auto arg = [&](Py_ssize_t k) -> PyObject* { return nargs > k && args[k] != Py_None ? args[k] : nullptr; };
  PyObject *idle = args[0], *fn = arg(1), *outputs = arg(2), *errors = arg(3), *claims = arg(4), *arrived = arg(6);
  PyObject* mine = nargs > 5 ? args[5] : Py_None;
  auto per_replica = [&](PyObject* list) { return !list || (PyList_Check(list) && PyList_GET_SIZE(list) == s->n); };
  if ((claims && !PyDict_Check(claims)) || !per_replica(arrived) || !per_replica(outputs) ||
      (errors && !PyList_Check(errors)) || (fn && (!outputs || !errors))) {
    PyErr_Format(PyExc_TypeError, "reset(): outputs and arrived must be lists of %d items, errors a list and claims "
                 "a dict (or None each; a run's fn needs outputs and errors)", s->n);
    return nullptr;
  }
  int woken = 1;
  if (nargs > 7 && (woken = PyObject_IsTrue(args[7])) < 0) return nullptr;
  if (idle != Py_None && (!s->getcurrent || !PyList_Check(idle))) {
    PyErr_SetString(PyExc_TypeError, "reset(idle): a list of idle greenlets needs cooperate() with greenlet "
                                     "first; None: replicas on threads only");
    return nullptr;
  }
  // An interrupted run's greenlets first: whatever their replicas do as they are dropped (GreenletExit)
  // lands on that run's state, cleared next, not on this run's.
  if (s->unfinished || !s->parked.empty() || !s->ready.empty() || (s->replicas && PySet_GET_SIZE(s->replicas)))
    clear_cooperative(s);
  // (Each parked replica takes its scope out of `stacked` as it resumes or is dropped; an interrupted run's
  // replica that is neither leaves its entry to no one.)
  std::vector<PyObject*> stale;
  stale.swap(s->stacked);
  for (PyObject* o : stale) Py_DECREF(o);
  clear_run(s);
  clear_pool_run(s);
  Py_CLEAR(s->hub);
  s->fn = Py_XNewRef(fn);
  s->outputs = Py_XNewRef(outputs);
  s->errors = Py_XNewRef(errors);
  s->claims = Py_XNewRef(claims);
  s->mine = Py_NewRef(mine);
  s->arrived_flags = Py_XNewRef(arrived);
  s->run_body = Py_XNewRef(body);
  s->next = 1;  // (replica 0 is the caller's own)
  s->woken = woken;
  s->started = std::chrono::steady_clock::now();
  if (cache_thread_dicts(s) < 0) return nullptr;
  if (idle == Py_None) Py_RETURN_NONE;
  s->hub = PyObject_CallNoArgs(s->getcurrent);
  if (!s->hub) return nullptr;
  Py_XSETREF(s->idle, Py_NewRef(idle));
  Py_RETURN_NONE;
}

// pool(complete, wake, handoff): how the replica pool hears of a run's end and is asked whether a step is
// long (see the method table).
PyObject* rv_pool(PyObject* self, PyObject* args) {
  State* s = reinterpret_cast<Rendezvous*>(self)->s;
  PyObject *complete, *wake;
  double handoff;
  if (!PyArg_ParseTuple(args, "OOd:pool", &complete, &wake, &handoff)) return nullptr;
  Py_XSETREF(s->complete, Py_NewRef(complete));
  Py_XSETREF(s->wake, Py_NewRef(wake));
  s->handoff = handoff;
  Py_RETURN_NONE;
}

PyObject* serve_replicas(PyObject*, PyObject* const* args, Py_ssize_t nargs);
PyMethodDef serve_def = {"serve_replicas", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(serve_replicas)),
                         METH_FASTCALL, "A cooperative replica's greenlet: runs replicas, one per start."};

// cooperate(state, gpu, greenlet): the thread state replicas take along when they share a thread, and the
// greenlet module (None: no greenlets, save_state()/restore_state() only).
PyObject* rv_cooperate(PyObject* self, PyObject* args) {
  State* s = reinterpret_cast<Rendezvous*>(self)->s;
  PyObject *state, *gpu, *greenlet;
  if (!PyArg_ParseTuple(args, "O!OO:cooperate", &PyTuple_Type, &state, &gpu, &greenlet)) return nullptr;
  std::vector<PyObject*> locals;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(state); ++i) {  // ((object, name, default), ...)
    PyObject* triple = PyTuple_GET_ITEM(state, i);
    if (!PyTuple_Check(triple) || PyTuple_GET_SIZE(triple) != 3 || !PyUnicode_Check(PyTuple_GET_ITEM(triple, 1))) {
      PyErr_SetString(PyExc_TypeError, "state: expected (object, name, default) triples");
      return nullptr;
    }
  }
  PyObject* gpu_parts[5] = {};
  if (gpu != Py_None) {
    if (!PyTuple_Check(gpu) || PyTuple_GET_SIZE(gpu) != 5 || !PyTuple_Check(PyTuple_GET_ITEM(gpu, 4))) {
      PyErr_SetString(PyExc_TypeError, "gpu: expected (running, getDevice, setDevice, get_current_stream, ordinals) "
                                       "or None");
      return nullptr;
    }
    for (int k = 0; k < 5; ++k) gpu_parts[k] = PyTuple_GET_ITEM(gpu, k);
  }
  PyObject *type = nullptr, *getcurrent = nullptr, *switch_fn = nullptr, *replicas = nullptr, *body = nullptr;
  if (greenlet != Py_None) {
    type = PyObject_GetAttrString(greenlet, "greenlet");
    getcurrent = PyObject_GetAttrString(greenlet, "getcurrent");
    switch_fn = type ? PyObject_GetAttrString(type, "switch") : nullptr;
    replicas = PySet_New(nullptr);
    body = PyCFunction_New(&serve_def, nullptr);
    if (!type || !getcurrent || !switch_fn || !replicas || !body) {
      for (PyObject* o : {type, getcurrent, switch_fn, replicas, body}) Py_XDECREF(o);
      return nullptr;
    }
  }
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(state); ++i)
    for (int k = 0; k < 3; ++k) locals.push_back(Py_NewRef(PyTuple_GET_ITEM(PyTuple_GET_ITEM(state, i), k)));
  for (PyObject* o : s->state_locals) Py_DECREF(o);
  s->state_locals = std::move(locals);
  PyObject** gpu_fields[5] = {&s->running, &s->get_device, &s->set_device, &s->current_stream, &s->ordinals};
  for (int k = 0; k < 5; ++k) Py_XSETREF(*gpu_fields[k], Py_XNewRef(gpu_parts[k]));
  Py_XSETREF(s->greenlet_type, type);
  Py_XSETREF(s->getcurrent, getcurrent);
  Py_XSETREF(s->switch_fn, switch_fn);
  Py_XSETREF(s->replicas, replicas);
  Py_XSETREF(s->body, body);
  s->has_state = true;
  if (track_locals(s) < 0) return nullptr;
  Py_RETURN_NONE;
}

// replica_body(entry_type, locals, scopes, gpu, out_of_memory, step_streams): the replicas' body (see run_body
// and the method table), set once.
PyObject* rv_replica_body(PyObject* self, PyObject* args) {
  State* s = reinterpret_cast<Rendezvous*>(self)->s;
  PyObject *entry_type, *locals, *scopes, *devices, *gpu, *out_of_memory, *step_streams;
  if (!PyArg_ParseTuple(args, "O!O!O!O!OOO:replica_body", &PyType_Type, &entry_type, &PyTuple_Type, &locals,
                        &PyList_Type, &scopes, &PyList_Type, &devices, &gpu, &out_of_memory, &step_streams))
    return nullptr;
  bool any_gpu = false;
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(scopes); ++i) any_gpu |= PyList_GET_ITEM(scopes, i) != Py_None;
  bool valid = PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(entry_type), &PyTuple_Type) &&
               PyTuple_GET_SIZE(locals) == 4 && PyList_GET_SIZE(scopes) == s->n && PyList_GET_SIZE(devices) == s->n &&
               (!any_gpu || (s->order && s->running && gpu != Py_None));
  for (Py_ssize_t k = 0; valid && k < 4; ++k) {
    PyObject* pair = PyTuple_GET_ITEM(locals, k);
    valid = PyTuple_Check(pair) && PyTuple_GET_SIZE(pair) == 2 && PyUnicode_Check(PyTuple_GET_ITEM(pair, 1));
  }
  if (!valid) {
    PyErr_Format(PyExc_TypeError, "replica_body(entry_type, locals, scopes, devices, gpu, out_of_memory, "
                 "step_streams): expected a tuple type, 4 (local, name) pairs (the context stack, the device, the name "
                 "scope, the running scope), %d scopes (None: a CPU replica) and %d devices, and for GPU replicas "
                 "device/gpu.py, after cooperate() with a GPU state and the order set", s->n, s->n);
    return nullptr;
  }
  // Each GPU scope's stream, ordinal and its kept park's saved state (new references; None for a CPU replica).
  std::vector<PyObject*> parts[3];
  auto drop = [&] {
    for (auto& part : parts)
      for (PyObject* o : part) Py_XDECREF(o);
  };
  for (Py_ssize_t i = 0; i < s->n; ++i) {
    PyObject* scope = PyList_GET_ITEM(scopes, i);
    if (scope == Py_None) {
      for (auto& part : parts) part.push_back(Py_NewRef(Py_None));
      continue;
    }
    PyObject* stream = PyObject_GetAttr(scope, str_stream);
    PyObject* ordinal = stream ? PyObject_GetAttr(scope, str_ordinal) : nullptr;
    PyObject* streams = ordinal ? PyTuple_Pack(1, stream) : nullptr;
    PyObject* kept = streams ? PyTuple_Pack(4, ordinal, streams, scope, Py_True) : nullptr;
    Py_XDECREF(streams);
    for (auto [part, o] : {std::pair{&parts[0], stream}, {&parts[1], ordinal}, {&parts[2], kept}}) part->push_back(o);
    if (!kept) {
      drop();
      return nullptr;
    }
  }
  for (int k = 0; k < 4; ++k)
    for (int j = 0; j < 2; ++j)
      Py_XSETREF(s->body_locals[k][j], Py_NewRef(PyTuple_GET_ITEM(PyTuple_GET_ITEM(locals, k), j)));
  std::vector<PyObject*>* fields[3] = {&s->body_streams, &s->body_ordinals, &s->body_kept};
  for (int k = 0; k < 3; ++k) {
    for (PyObject* o : *fields[k]) Py_DECREF(o);
    fields[k]->swap(parts[k]);  // (the references move)
  }
  for (auto [field, list] : {std::pair{&s->body_scopes, scopes}, {&s->body_devices, devices}}) {
    for (PyObject* o : *field) Py_DECREF(o);
    field->clear();
    for (Py_ssize_t i = 0; i < s->n; ++i) field->push_back(Py_NewRef(PyList_GET_ITEM(list, i)));
  }
  Py_XSETREF(s->entry_type, Py_NewRef(entry_type));
  Py_XSETREF(s->gpu_module, gpu == Py_None ? nullptr : Py_NewRef(gpu));
  Py_XSETREF(s->out_of_memory, Py_NewRef(out_of_memory));
  Py_XSETREF(s->step_streams, Py_NewRef(step_streams));
  if (track_locals(s) < 0) return nullptr;
  Py_RETURN_NONE;
}

bool has_state(const State* s) {
  if (s->has_state) return true;
  PyErr_SetString(PyExc_RuntimeError, "save_state()/restore_state(): cooperate() first (it says what the state is)");
  return false;
}

PyObject* rv_save_state(PyObject* self, PyObject*) {
  State* s = reinterpret_cast<Rendezvous*>(self)->s;
  return has_state(s) ? save_state(s) : nullptr;
}

PyObject* rv_restore_state(PyObject* self, PyObject* saved) {
  State* s = reinterpret_cast<Rendezvous*>(self)->s;
  if (!has_state(s) || restore_state(s, saved) < 0) return nullptr;
  Py_RETURN_NONE;
}

// Parses (i, caller) of arrive().
bool index_and_caller(PyObject* const* args, Py_ssize_t nargs, const char* name, long* i, bool* caller) {
  if (nargs != 2) {
    PyErr_Format(PyExc_TypeError, "%s(i, caller) takes 2 arguments (%zd given)", name, nargs);
    return false;
  }
  *i = PyLong_AsLong(args[0]);
  if (*i == -1 && PyErr_Occurred()) return false;
  const int truth = PyObject_IsTrue(args[1]);
  if (truth < 0) return false;
  *caller = truth;
  return true;
}

PyObject* rv_arrive(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  long i;
  bool caller;
  if (!index_and_caller(args, nargs, "arrive", &i, &caller) ||
      arrive(reinterpret_cast<Rendezvous*>(self)->s, i, caller) < 0)
    return nullptr;
  Py_RETURN_NONE;
}

PyObject* rv_claim(PyObject* self, PyObject*) { return claim(reinterpret_cast<Rendezvous*>(self)->s); }

// The run is over, every replica returned: what it held goes now, not at the next run's reset. The replicas'
// function and body and the last collective's results hold the strategy (its optimizer's plans, the
// arrays), and the pool's threads sleeping in this group would keep a strategy the program dropped alive,
// and with it those threads and its device memory.
PyObject* rv_end_run(PyObject* self, PyObject*) {
  State* s = reinterpret_cast<Rendezvous*>(self)->s;
  if (!initialised(s)) return nullptr;
  // (Greenlet replicas not returned, after an interruption: the next run's reset drops them first.)
  if (s->unfinished || !s->parked.empty() || !s->ready.empty()) Py_RETURN_NONE;
  clear_run(s);
  clear_pool_run(s);
  Py_RETURN_NONE;
}

PyObject* rv_abort(PyObject* self, PyObject*) {
  State* s = reinterpret_cast<Rendezvous*>(self)->s;
  if (!initialised(s) || abort_group(s) < 0) return nullptr;
  Py_RETURN_NONE;
}

// Sets the exception being raised as the context of the one a `finally` step raised after it (as Python
// chains them), or puts it back when the step raised none; (type, value, traceback): PyErr_Fetch's, stolen.
void chain_error(PyObject* type, PyObject* value, PyObject* traceback) {
  if (!type) return;
  if (!PyErr_Occurred()) {
    PyErr_Restore(type, value, traceback);
    return;
  }
  PyErr_NormalizeException(&type, &value, &traceback);
  if (traceback) PyException_SetTraceback(value, traceback);
  PyObject *later_type, *later, *later_traceback;
  PyErr_Fetch(&later_type, &later, &later_traceback);
  PyErr_NormalizeException(&later_type, &later, &later_traceback);
  if (later != value) PyException_SetContext(later, value);  // (steals value)
  else Py_DECREF(value);
  Py_DECREF(type);
  Py_XDECREF(traceback);
  PyErr_Restore(later_type, later, later_traceback);
}

// Runs `step` (-> 0, or -1 with an error) as a `finally` block does: what is being raised, if anything, is put
// aside meanwhile and raised after it, unless the step raises, whose error then replaces it (chained).
template <typename Step>
void as_finally(Step&& step) {
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  step();
  chain_error(type, value, traceback);
}

// Replica i's call of the run's function `fn` with its arguments (`column[i]` alone, else `arguments[i]`'s
// (args, kwargs), else none): a new reference to its result, or null with its error.
PyObject* call_step(PyObject* fn, PyObject* column, PyObject* arguments, long i) {
  if (column != Py_None) {
    PyObject* arg = PySequence_Fast_GET_ITEM(column, i);
    return PyObject_Vectorcall(fn, &arg, 1, nullptr);
  }
  if (arguments == Py_None) return PyObject_CallNoArgs(fn);
  PyObject* pair = PySequence_Fast(PySequence_Fast_GET_ITEM(arguments, i), "a replica's (args, kwargs)");
  if (!pair) return nullptr;
  PyObject* result = nullptr;
  if (PySequence_Fast_GET_SIZE(pair) != 2) {
    PyErr_SetString(PyExc_ValueError, "a replica's arguments: expected (args, kwargs)");
  } else if (PyObject* args = PySequence_Tuple(PySequence_Fast_GET_ITEM(pair, 0))) {
    PyObject* kwargs = PySequence_Fast_GET_ITEM(pair, 1);
    const int named = PyObject_IsTrue(kwargs);
    PyObject* dict = named == 1 && !PyDict_Check(kwargs) ? PyDict_New() : nullptr;
    if (dict && PyDict_Merge(dict, kwargs, 1) < 0) Py_CLEAR(dict);
    if (named == 0) result = PyObject_Call(fn, args, nullptr);
    else if (named == 1 && (dict || PyDict_Check(kwargs))) result = PyObject_Call(fn, args, dict ? dict : kwargs);
    Py_XDECREF(dict);
    Py_DECREF(args);
  }
  Py_DECREF(pair);
  return result;
}

// Makes GPU `ordinal` current unless it is (State's get_device/set_device: CuPy's). 0, or -1 with an error.
int on_device(State* s, PyObject* ordinal) {
  const long want = PyLong_AsLong(ordinal);
  const long now = want == -1 && PyErr_Occurred() ? -1 : current_device(s);
  if (now == -1 && PyErr_Occurred()) return -1;
  return now != want ? set_device(s, ordinal) : 0;
}

// `waiter.wait_event(recorded.record())` with the GPU `ordinal` current: `waiter` queues after the work `recorded`
// queued so far (the fork and the join of a replica's stream with its GPU's step stream, inside md.function).
int wait_for(State* s, PyObject* ordinal, PyObject* waiter, PyObject* recorded) {
  if (on_device(s, ordinal) < 0) return -1;
  PyObject* event = PyObject_CallMethodNoArgs(recorded, str_record);
  PyObject* r = event ? PyObject_CallMethodOneArg(waiter, str_wait_event, event) : nullptr;
  Py_XDECREF(event);
  Py_XDECREF(r);
  return r ? 0 : -1;
}

// Replica i of the run (`body`: reset()'s) runs the step's function: its context on the thread's context stack,
// the run's name scope, its md device; a GPU replica, on its GPU and stream, entered as `with stream` does (with
// its GPU current: CuPy checks that first), and, once the function returned or raised, left; then the merge
// order told (order.finish) when it holds work for the replica. Outside md.function a GPU replica's stream is
// its scope's own; inside (device/gpu.py `_step`), step_streams(scope, step) says (stream, memory, origin): the
// step's stream or a fork of it (`origin`: the step stream it forks from and joins again after the function),
// and the step's memory, entered inside the stream, and `_entry` holds the three while the function runs (the
// park and the resume read it; outside md.function the scope's stream is found by the scope). A CuPy
// out-of-memory error becomes md's ResourceExhaustedError (gpu.raise_if_out_of_memory). Returns a new reference
// to the function's result, or null with what it raised.
PyObject* run_body(State* s, PyObject* body, long i) {
  PyObject *fn = PyTuple_GET_ITEM(body, 0), *column = PyTuple_GET_ITEM(body, 1),
           *arguments = PyTuple_GET_ITEM(body, 2), *strategy = PyTuple_GET_ITEM(body, 3),
           *contexts = PyTuple_GET_ITEM(body, 4), *name_scope = PyTuple_GET_ITEM(body, 5);
  PyObject *scope = s->body_scopes[i], *ordinal = s->body_ordinals[i];
  const bool gpu = scope != Py_None;
  auto* entry_type = reinterpret_cast<PyTypeObject*>(s->entry_type);
  PyObject* result = nullptr;
  // A GPU replica's stream, step memory and fork origin (new references; memory and origin None outside
  // md.function).
  PyObject *stream = nullptr, *memory = Py_NewRef(Py_None), *origin = Py_NewRef(Py_None), *entry = nullptr;
  bool ready = true;
  if (gpu) {
    PyObject* step = module_global(s->gpu_module, str_step);
    if (!step) {
      ready = false;
    } else if (step == Py_None) {
      stream = Py_NewRef(s->body_streams[i]);
    } else {
      PyObject* parts = PyObject_CallFunctionObjArgs(s->step_streams, scope, step, nullptr);
      if (parts && PyTuple_Check(parts) && PyTuple_GET_SIZE(parts) == 3) {
        stream = Py_NewRef(PyTuple_GET_ITEM(parts, 0));
        Py_SETREF(memory, Py_NewRef(PyTuple_GET_ITEM(parts, 1)));
        Py_SETREF(origin, Py_NewRef(PyTuple_GET_ITEM(parts, 2)));
        entry = Py_NewRef(parts);
      } else if (parts) {
        PyErr_SetString(PyExc_TypeError, "step_streams(scope, step): expected (stream, memory, origin)");
      }
      Py_XDECREF(parts);
      ready = stream != nullptr;
    }
    Py_XDECREF(step);
  }
  // (A new list each run: the replica may push on its stack. The entry as tuple.__new__(_Context, ...) makes it.)
  PyObject* context = ready ? entry_type->tp_alloc(entry_type, 2) : nullptr;
  PyObject* stack = context ? PyList_New(1) : nullptr;
  if (stack) {
    PyTuple_SET_ITEM(context, 0, Py_NewRef(strategy));
    PyTuple_SET_ITEM(context, 1, Py_NewRef(PySequence_Fast_GET_ITEM(contexts, i)));
    PyList_SET_ITEM(stack, 0, context);
    context = nullptr;
  }
  Py_XDECREF(context);
  PyObject* const* dicts = thread_dicts(s);
  auto put = [&](int k, PyObject* value) {
    return set_local(dicts, s->body_tls[k], s->body_locals[k][0], s->body_locals[k][1], value) == 0;
  };
  bool entered = stack && put(0, stack) && put(2, name_scope) && put(1, s->body_devices[i]);
  Py_XDECREF(stack);
  if (entered && gpu) {
    if (origin != Py_None && wait_for(s, ordinal, stream, origin) < 0) {  // the fork, with the stream's GPU current
      entered = false;
    } else {
      PyObject* r = PyObject_CallMethodNoArgs(stream, str_enter);
      if (!r && PyErr_ExceptionMatches(PyExc_RuntimeError)) {  // another device is current
        PyErr_Clear();
        r = set_device(s, ordinal) == 0 ? PyObject_CallMethodNoArgs(stream, str_enter) : nullptr;
      }
      Py_XDECREF(r);
      entered = r != nullptr;
    }
    if (entered && memory != Py_None) {
      PyObject* r = PyObject_CallMethodNoArgs(memory, str_enter);
      Py_XDECREF(r);
      if (!r) {  // (the stream back off, as a failing `with` inside another leaves the outer one)
        as_finally([&] {
          PyObject* e = PyObject_CallMethodObjArgs(stream, str_exit, Py_None, Py_None, Py_None, nullptr);
          Py_XDECREF(e);
          return e ? 0 : -1;
        });
        entered = false;
      }
    }
  }
  if (entered) {
    if ((!entry || PyObject_SetAttr(scope, str_entry, entry) == 0) && (!gpu || put(3, scope))) {
      result = call_step(fn, column, arguments, i);
      if (!result && gpu && PyErr_ExceptionMatches(PyExc_MemoryError)) {  // CuPy's OutOfMemoryError is one
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        PyErr_NormalizeException(&type, &value, &traceback);
        PyObject* r = value ? PyObject_CallFunctionObjArgs(s->out_of_memory, value, ordinal, nullptr) : nullptr;
        Py_XDECREF(r);
        if (r) PyErr_Restore(type, value, traceback);
        else chain_error(type, value, traceback);
      }
    }
    if (gpu)
      as_finally([&] {  // (a failing step ends it, as in a `finally` block)
        if (entry && PyObject_SetAttr(scope, str_entry, Py_None) < 0) return -1;
        if (memory != Py_None) {
          PyObject* r = PyObject_CallMethodObjArgs(memory, str_exit, Py_None, Py_None, Py_None, nullptr);
          if (!r) return -1;
          Py_DECREF(r);
        }
        // (On top of CuPy's stack: whatever the replica entered after it has been left.)
        PyObject* r = PyObject_CallMethodObjArgs(stream, str_exit, Py_None, Py_None, Py_None, nullptr);
        if (!r) return -1;
        Py_DECREF(r);
        dicts = thread_dicts(s);  // (again: the step ran in between)
        if (!put(3, Py_None)) return -1;
        // The join, with the stream's GPU current (the replica may have left it).
        return origin != Py_None ? wait_for(s, ordinal, origin, stream) : 0;
      });
  }
  Py_XDECREF(stream);
  Py_DECREF(memory);
  Py_DECREF(origin);
  Py_XDECREF(entry);
  if (s->order)
    as_finally([&] {  // (work handed to the replica to let go: rare)
      PyObject* pending = PyObject_GetAttr(s->order, str_pending);
      const int truth = pending ? PyObject_IsTrue(pending) : -1;
      Py_XDECREF(pending);
      if (truth <= 0) return truth;
      PyObject* index = PyLong_FromLong(i);
      PyObject* r = index ? PyObject_CallMethodOneArg(s->order, str_finish, index) : nullptr;
      Py_XDECREF(index);
      Py_XDECREF(r);
      return r ? 0 : -1;
    });
  if (PyErr_Occurred()) Py_CLEAR(result);
  return result;
}

// Runs replica `i` on this thread (`caller`: the run's caller's, else a replica thread's) and keeps what it
// returns or raises (the first error is the run's; the group breaks so no replica waits for this one);
// replicas 1..n-1 then arrive. A failed run skips the replicas the caller has not started. -1 only if the
// bookkeeping itself failed (out of memory).
int execute(State* s, long i, bool caller) {
  if (!s->fn || i < 0 || i >= s->n) {
    PyErr_Format(PyExc_RuntimeError, "run_replica(%ld): no run under way (reset() with the run's function first)", i);
    return -1;
  }
  int rc = 0;
  if (!(i && caller && PyList_GET_SIZE(s->errors))) {
    // (Held: a replica interrupted by Ctrl-C may outlive its run, see _ReplicaPool.run.)
    PyObject* fn = Py_NewRef(s->fn);
    PyObject* body = Py_XNewRef(s->run_body);
    PyObject* outputs = Py_NewRef(s->outputs);
    PyObject* errors = Py_NewRef(s->errors);
    PyObject* index = nullptr;
    PyObject* result = nullptr;
    if (body) result = run_body(s, body, i);
    else if ((index = PyLong_FromLong(i))) result = PyObject_CallOneArg(fn, index);
    if (result) {
      rc = PyList_SetItem(outputs, i, result);  // (steals)
    } else if (!PyErr_ExceptionMatches(s->aborted_type)) {
      PyObject* error = take_error();
      rc = error && PyList_Append(errors, error) == 0 ? 0 : -1;
      Py_XDECREF(error);
      if (rc == 0) rc = abort_group(s);  // (release the replicas waiting for this one in a collective)
      else notify(s);
    } else {
      PyErr_Clear();
    }
    Py_XDECREF(index);
    Py_DECREF(fn);
    Py_XDECREF(body);
    Py_DECREF(outputs);
    Py_DECREF(errors);
  }
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  if (++s->finished == s->n) {  // every replica returned: the run's function goes (it may hold the strategy)
    Py_CLEAR(s->fn);
    Py_CLEAR(s->run_body);
    Py_CLEAR(s->outputs);
    Py_CLEAR(s->errors);
  }
  int done = s->arrived ? check_stranded(s) : 0;  // someone waits: is it stranded now?
  if (i && arrive(s, i, caller) < 0) done = -1;
  if (type) {
    if (PyErr_Occurred()) PyErr_Clear();
    PyErr_Restore(type, value, traceback);
  }
  return rc < 0 || done < 0 ? -1 : 0;
}

PyObject* rv_run_replica(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs < 1 || nargs > 2) {
    PyErr_Format(PyExc_TypeError, "run_replica(i, caller=True) takes 1 or 2 arguments (%zd given)", nargs);
    return nullptr;
  }
  const long i = PyLong_AsLong(args[0]);
  if (i == -1 && PyErr_Occurred()) return nullptr;
  const int caller = nargs > 1 ? PyObject_IsTrue(args[1]) : 1;
  if (caller < 0 || execute(reinterpret_cast<Rendezvous*>(self)->s, i, caller) < 0) return nullptr;
  Py_RETURN_NONE;
}

// A greenlet replica returned: its greenlet (the current one) goes back to the idle ones, and the thread on
// to a ready replica (a round trip through the hub saved), else to the hub. Returns what the greenlet's next
// start passes.
PyObject* retire(State* s) {
  if (!s->hub) {
    PyErr_SetString(PyExc_RuntimeError, "a greenlet replica returned outside a cooperative run");
    return nullptr;
  }
  PyObject* g = PyObject_CallNoArgs(s->getcurrent);
  if (!g) return nullptr;
  --s->unfinished;
  const int rc = PySet_Discard(s->replicas, g) < 0 || PyList_Append(s->idle, g) < 0 ? -1 : 0;
  Py_DECREF(g);
  if (rc < 0) return nullptr;
  PyObject* target;
  if (!s->ready.empty()) {
    target = s->ready.back();
    s->ready.pop_back();
  } else {
    target = Py_NewRef(s->hub);
  }
  PyObject* r = switch_to(s, target);
  Py_DECREF(target);
  return r;
}

// A cooperative replica's greenlet (its run function): runs replicas, one per start (rendezvous, index),
// for as long as its thread lives (execute() keeps whatever a replica returns or raises).
PyObject* serve_replicas(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyObject_TypeCheck(args[0], rendezvous_type) || !PyLong_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "a replica greenlet starts with (rendezvous, index)");
    return nullptr;
  }
  PyObject* group = Py_NewRef(args[0]);
  PyObject* index = Py_NewRef(args[1]);
  for (;;) {
    State* s = reinterpret_cast<Rendezvous*>(group)->s;
    const long i = PyLong_AsLong(index);
    PyObject* next = i == -1 && PyErr_Occurred() ? nullptr : execute(s, i, true) < 0 ? nullptr : retire(s);
    Py_DECREF(group);
    Py_DECREF(index);
    if (!next) return nullptr;
    if (!PyTuple_Check(next) || PyTuple_GET_SIZE(next) != 2) {
      Py_DECREF(next);
      PyErr_SetString(PyExc_TypeError, "a replica greenlet resumes with (rendezvous, index)");
      return nullptr;
    }
    group = Py_NewRef(PyTuple_GET_ITEM(next, 0));
    index = Py_NewRef(PyTuple_GET_ITEM(next, 1));
    Py_DECREF(next);
  }
}

// Resumes ready replicas until every greenlet replica returned, sleeping while none is ready (they wait for
// replicas on other threads).
PyObject* rv_drain(PyObject* self, PyObject*) {
  State* s = reinterpret_cast<Rendezvous*>(self)->s;
  while (s->unfinished) {
    while (s->ready.empty())
      if (sleep(s) < 0) return nullptr;
    if (switch_ready(s) < 0) return nullptr;
  }
  Py_RETURN_NONE;
}

// After an abort: lets every greenlet replica return (they raise _Aborted).
PyObject* rv_finish_aborted(PyObject* self, PyObject*) {
  State* s = reinterpret_cast<Rendezvous*>(self)->s;
  while (s->unfinished && !s->ready.empty())
    if (switch_ready(s) < 0) return nullptr;
  Py_RETURN_NONE;
}

int rv_init(PyObject* self, PyObject* args, PyObject* kwargs) {
  static const char* names[] = {"n", "aborted", "tracing", "traced", "stack", nullptr};
  int n;
  PyObject *aborted, *tracing, *traced, *stack = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "iOOO|O:Rendezvous", const_cast<char**>(names), &n, &aborted,
                                   &tracing, &traced, &stack))
    return -1;
  if (n < 1) {
    PyErr_Format(PyExc_ValueError, "n=%d: a rendezvous needs at least one replica", n);
    return -1;
  }
  if (PyTuple_Check(tracing) && (PyTuple_GET_SIZE(tracing) != 2 || !PyUnicode_Check(PyTuple_GET_ITEM(tracing, 1)))) {
    PyErr_SetString(PyExc_TypeError, "tracing: expected a callable, or the (module, name) of a global that is true "
                                     "while the timeline records");
    return -1;
  }
  if (stack != Py_None &&
      (!PyTuple_Check(stack) || PyTuple_GET_SIZE(stack) != 2 || !PyUnicode_Check(PyTuple_GET_ITEM(stack, 1)))) {
    PyErr_SetString(PyExc_TypeError, "stack: expected the (local, name) of the thread's context stack, or None");
    return -1;
  }
  State* s = reinterpret_cast<Rendezvous*>(self)->s;
  clear_run(s);
  s->n = n;
  clear_pool_run(s);
  s->slots.assign(n, nullptr);
  s->kinds.assign(n, nullptr);
  Py_XSETREF(s->aborted_type, Py_NewRef(aborted));
  Py_XSETREF(s->tracing, Py_NewRef(tracing));
  Py_XSETREF(s->traced, Py_NewRef(traced));
  for (int k = 0; k < 2; ++k)
    Py_XSETREF(s->stack_local[k], stack == Py_None ? nullptr : Py_NewRef(PyTuple_GET_ITEM(stack, k)));
  return track_locals(s);
}

PyObject* rv_new(PyTypeObject* type, PyObject*, PyObject*) {
  PyObject* self = type->tp_alloc(type, 0);
  if (!self) return nullptr;
  reinterpret_cast<Rendezvous*>(self)->s = new State();
  return self;
}

template <typename F>
void each_reference(State* s, F&& visit) {
  for (PyObject* o : s->slots) visit(o);
  for (PyObject* o : s->kinds) visit(o);
  for (PyObject* o : s->state_locals) visit(o);
  for (PyObject* o : s->parked) visit(o);
  for (PyObject* o : s->ready) visit(o);
  for (PyObject* o : s->stacked) visit(o);
  for (PyObject* o : s->tls_locals) visit(o);
  for (PyObject* o : s->tls_dicts) visit(o);
  for (auto* part : {&s->body_scopes, &s->body_streams, &s->body_ordinals, &s->body_devices, &s->body_kept})
    for (PyObject* o : *part) visit(o);
  for (auto& local : s->body_locals) {
    visit(local[0]);
    visit(local[1]);
  }
  for (PyObject* o : {s->entry_type, s->gpu_module, s->out_of_memory, s->step_streams, s->run_body, s->stack_local[0],
                      s->stack_local[1]})
    visit(o);
  for (PyObject* o : {s->results, s->broken, s->order, s->arrival_parts, s->aborted_type, s->tracing, s->traced,
                      s->fn, s->outputs, s->errors,
                      s->complete, s->wake, s->claims, s->mine, s->arrived_flags, s->running, s->get_device,
                      s->set_device, s->current_stream, s->ordinals, s->body, s->greenlet_type, s->getcurrent,
                      s->switch_fn, s->hub, s->idle, s->replicas})
    visit(o);
}

int rv_traverse(PyObject* self, visitproc visit, void* arg) {
  Py_VISIT(Py_TYPE(self));
  State* s = reinterpret_cast<Rendezvous*>(self)->s;
  int rc = 0;
  if (s) each_reference(s, [&](PyObject* o) { if (o && !rc) rc = visit(o, arg); });
  return rc;
}

int rv_clear(PyObject* self) {
  State* s = reinterpret_cast<Rendezvous*>(self)->s;
  if (!s) return 0;
  // Moved out first: a decref may run code that reaches this object again.
  std::vector<PyObject*> dropped;
  each_reference(s, [&](PyObject* o) { if (o) dropped.push_back(o); });
  for (PyObject*& o : s->slots) o = nullptr;
  for (PyObject*& o : s->kinds) o = nullptr;
  s->state_locals.clear();
  s->parked.clear();
  s->ready.clear();
  s->stacked.clear();
  s->tls_locals.clear();
  s->tls_dicts.clear();
  s->tls_thread = 0;
  for (auto* part : {&s->body_scopes, &s->body_streams, &s->body_ordinals, &s->body_devices, &s->body_kept})
    part->clear();
  for (auto& local : s->body_locals) local[0] = local[1] = nullptr;
  for (PyObject** o : {&s->entry_type, &s->gpu_module, &s->out_of_memory, &s->step_streams, &s->run_body,
                       &s->stack_local[0], &s->stack_local[1]})
    *o = nullptr;
  for (PyObject** o : {&s->results, &s->broken, &s->order, &s->arrival_parts, &s->aborted_type, &s->tracing, &s->traced,
                       &s->fn, &s->outputs, &s->errors, &s->complete, &s->wake, &s->claims, &s->mine, &s->arrived_flags, &s->running,
                       &s->get_device, &s->set_device, &s->current_stream, &s->ordinals, &s->body,
                       &s->greenlet_type, &s->getcurrent,
                       &s->switch_fn, &s->hub, &s->idle, &s->replicas})
    *o = nullptr;
  s->unfinished = 0;
  for (PyObject* o : dropped) Py_DECREF(o);
  return 0;
}

void rv_dealloc(PyObject* self) {
  PyTypeObject* type = Py_TYPE(self);
  PyObject_GC_UnTrack(self);
  rv_clear(self);
  delete reinterpret_cast<Rendezvous*>(self)->s;
  type->tp_free(self);
  Py_DECREF(type);
}

PyObject* rv_get_n(PyObject* self, void*) { return PyLong_FromLong(reinterpret_cast<Rendezvous*>(self)->s->n); }

PyObject* rv_get_unclaimed(PyObject* self, void*) {
  State* s = reinterpret_cast<Rendezvous*>(self)->s;
  return PyBool_FromLong(s->next < s->n);
}

PyObject* rv_get_completed(PyObject* self, void*) {
  return PyBool_FromLong(reinterpret_cast<Rendezvous*>(self)->s->completed);
}

PyObject* rv_get_unfinished(PyObject* self, void*) {
  return PyLong_FromLong(reinterpret_cast<Rendezvous*>(self)->s->unfinished);
}

PyObject* rv_get_order(PyObject* self, void*) {
  PyObject* order = reinterpret_cast<Rendezvous*>(self)->s->order;
  return Py_NewRef(order ? order : Py_None);
}

int rv_set_order(PyObject* self, PyObject* value, void*) {
  State* s = reinterpret_cast<Rendezvous*>(self)->s;
  PyObject* parts = nullptr;
  if (value && value != Py_None) {
    parts = PyObject_CallMethodNoArgs(value, str_arrival_parts);
    if (!parts) return -1;
    if (!PyTuple_Check(parts) || PyTuple_GET_SIZE(parts) != 4 || !PyTuple_Check(PyTuple_GET_ITEM(parts, 0)) ||
        !PyAnySet_Check(PyTuple_GET_ITEM(parts, 2))) {
      Py_DECREF(parts);
      PyErr_SetString(PyExc_TypeError, "order.arrival_parts(): expected (ordinals tuple, get_current_stream, set of "
                                       "replica stream handles, module with _step)");
      return -1;
    }
  }
  Py_XSETREF(s->arrival_parts, parts);
  Py_XSETREF(s->order, value && value != Py_None ? Py_NewRef(value) : nullptr);
  return 0;
}

PyMethodDef rv_methods[] = {
    {"exchange", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(rv_exchange)), METH_FASTCALL,
     "exchange(rid, kind, payload, combine, context=None): replica rid's part of combine(every replica's payload), "
     "which the last replica to arrive runs; raises what broke the group. combine: a callable, or (first, "
     "combine): first(slots) is tried before the GPU replicas' merge order (no replica on a stream of the user's, "
     "no md.function step), combine(slots) in the order when it returns None. context: the replica's "
     "ReplicaContext, checked to be the thread's current one first (its _require_current(kind) raises when it "
     "is not)."},
    {"_exchange", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(rv_exchange_untraced)), METH_FASTCALL,
     "exchange() without the timeline's check (the traced exchange runs it inside its span)."},
    {"reset", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(rv_reset)), METH_FASTCALL,
     "reset(idle, fn=None, outputs=None, errors=None, claims=None, mine=None, arrived=None, woken=True): ready "
     "for a run. idle: the calling thread's idle greenlets (the caller runs replicas as greenlets), or None "
     "(replicas on threads only); fn: the run's replica function (run_replica(i) sets outputs[i] = fn(i), or "
     "appends to errors what it raised); claims: the "
     "run's {index: token} that claim() and the replica threads fill (None: claim() claims every replica); "
     "mine: the caller's token; arrived: the run's list of n flags that arrive() sets; woken: the threads "
     "already take replicas (claim() does not ask wake()); body: (fn, column, arguments, strategy, contexts, "
     "name_scope) after replica_body(): replica i runs fn(column[i]), fn(*args, **kwargs) of arguments[i], or fn() "
     "in the replicas' body (instead of the run's fn(i))."},
    {"pool", rv_pool, METH_VARARGS,
     "pool(complete, wake, handoff): complete() when the last of replicas 1..n-1 arrived on a thread of its own (on the caller's: "
     "`completed`); wake() -> whether the step is long, asked "
     "by claims once it has run handoff seconds."},
    {"cooperate", rv_cooperate, METH_VARARGS,
     "cooperate(state, gpu, greenlet): the thread state that replicas sharing a thread take along ((object, "
     "name, default) triples, and gpu: (running, getDevice, setDevice, get_current_stream, ordinals) or None), "
     "and the greenlet module the caller runs replicas with (None: none)."},
    {"replica_body", rv_replica_body, METH_VARARGS,
     "replica_body(entry_type, locals, scopes, devices, gpu, out_of_memory, step_streams): the replicas' body (a "
     "run's reset() with a body): each sets its context stack to [entry_type((strategy, its context))], the md "
     "device to devices[i] and the name scope to the run's (locals: the (local, name) pairs of the context stack, "
     "the device, the name scope and the running scope); a GPU replica (scopes[i], a _GpuReplicaScope; None: a "
     "CPU replica) enters its stream (outside md.function its scope's `_stream`; inside, the (stream, memory, "
     "origin) of step_streams(scope, device/gpu.py's `_step`): the step's memory entered too, and a fork of the "
     "step stream `origin` joined at the end), runs the step and leaves; gpu: device/gpu.py, or None (no GPU "
     "replica); out_of_memory(error, ordinal): raises CuPy's out-of-memory error as md's."},
    {"save_state", rv_save_state, METH_NOARGS, "The thread's state, as cooperate() says."},
    {"restore_state", rv_restore_state, METH_O, "restore_state(saved): puts back what save_state() returned."},
    {"claim", rv_claim, METH_NOARGS,
     "The index of the next replica the caller runs itself, or None once every replica is claimed."},
    {"arrive", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(rv_arrive)), METH_FASTCALL,
     "arrive(i, caller): replica i (1..n-1) is done with the run (caller: on the run's caller's thread)."},
    {"end_run", rv_end_run, METH_NOARGS,
     "The run is over (every replica returned): drops what it held (its function and body, the last "
     "collective's results), so a dropped strategy is not kept alive by its pool's threads."},
    {"abort", rv_abort, METH_NOARGS, "Breaks the group (a replica failed): every waiting replica raises _Aborted."},
    {"run_replica", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(rv_run_replica)), METH_FASTCALL,
     "run_replica(i, caller=True): runs replica i of the run on this thread (caller: the run's caller's) and "
     "keeps its result or error (reset() says where); replicas 1..n-1 then arrive."},
    {"drain", rv_drain, METH_NOARGS, "Resumes ready replicas until every greenlet replica returned."},
    {"finish_aborted", rv_finish_aborted, METH_NOARGS, "After an abort: lets every greenlet replica return."},
    {nullptr, nullptr, 0, nullptr}};

PyGetSetDef rv_getset[] = {
    {"n", rv_get_n, nullptr, "Replicas that meet.", nullptr},
    {"unclaimed", rv_get_unclaimed, nullptr, "Whether claim() may still find a replica this run.", nullptr},
    {"completed", rv_get_completed, nullptr,
     "Whether the last of replicas 1..n-1 arrived on the caller's thread this run (arrive(i, True)).", nullptr},
    {"unfinished", rv_get_unfinished, nullptr, "Greenlet replicas started and not returned.", nullptr},
    {"order", rv_get_order, rv_set_order,
     "GPU replicas' MergeOrder, or None (set: the rendezvous notes each arrival, see order.arrival_parts()).", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyType_Slot rv_slots[] = {
    {Py_tp_doc, const_cast<char*>("Where the replicas of one strategy.run meet for each collective "
                                  "(distribute_lib._Group).")},
    {Py_tp_new, reinterpret_cast<void*>(rv_new)},
    {Py_tp_init, reinterpret_cast<void*>(rv_init)},
    {Py_tp_dealloc, reinterpret_cast<void*>(rv_dealloc)},
    {Py_tp_traverse, reinterpret_cast<void*>(rv_traverse)},
    {Py_tp_clear, reinterpret_cast<void*>(rv_clear)},
    {Py_tp_methods, rv_methods},
    {Py_tp_getset, rv_getset},
    {0, nullptr}};

PyType_Spec rv_spec = {"mirrored._core.Rendezvous", sizeof(Rendezvous), 0,
                       Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC, rv_slots};


// --- md.get_replica_context and a replica context's repeated all_reduce, with no Python frame --------------
//
// Every replica's collective starts with these two calls (`md.get_replica_context().all_reduce(op, x)`): two
// Python frames a replica, about as much host work as the rest of its part in the exchange.

// get_replica_context's state: the thread-local of the context stack. (Its thread's dict is not kept, as
// the rendezvous keeps its caller's: this getter serves every thread, and a kept dict of a thread that ended
// would hold that thread's context stack, and with it a strategy, until another thread asks.)
struct StackTop {
  PyObject_HEAD
  PyObject* local;     // context._local
  PyObject* name;      // "stack"
  PyObject* fallback;  // () -> the replica context outside any strategy's replica (the default one, or None)
};

PyTypeObject* stack_top_type;

// get_replica_context(): the top entry's replica context (a _Context is a (strategy, replica context) tuple);
// the fallback's answer for an empty or unset stack, or an entry of another form.
PyObject* stack_top_replica_context(PyObject* self, PyObject*) {
  auto* top = reinterpret_cast<StackTop*>(self);
  if (!top->local || !top->fallback) {
    PyErr_SetString(PyExc_RuntimeError, "get_replica_context: its state was cleared (the module is shutting down)");
    return nullptr;
  }
  PyObject* stack = PyObject_GetAttr(top->local, top->name);
  if (!stack) {
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return nullptr;
    PyErr_Clear();  // (a thread that never entered a strategy)
  }
  const Py_ssize_t depth = stack && PyList_Check(stack) ? PyList_GET_SIZE(stack) : 0;
  PyObject* entry = depth ? PyList_GET_ITEM(stack, depth - 1) : nullptr;
  PyObject* context = entry && PyTuple_Check(entry) && PyTuple_GET_SIZE(entry) == 2
                      ? Py_NewRef(PyTuple_GET_ITEM(entry, 1)) : nullptr;
  Py_XDECREF(stack);
  return context ? context : PyObject_CallNoArgs(top->fallback);
}

void stack_top_dealloc(PyObject* self) {
  PyTypeObject* type = Py_TYPE(self);
  PyObject_GC_UnTrack(self);
  auto* top = reinterpret_cast<StackTop*>(self);
  Py_CLEAR(top->local);
  Py_CLEAR(top->name);
  Py_CLEAR(top->fallback);
  type->tp_free(self);
  Py_DECREF(type);
}

int stack_top_traverse(PyObject* self, visitproc visit, void* arg) {
  auto* top = reinterpret_cast<StackTop*>(self);
  Py_VISIT(Py_TYPE(self));
  Py_VISIT(top->local);
  Py_VISIT(top->fallback);
  return 0;
}

int stack_top_clear(PyObject* self) {
  auto* top = reinterpret_cast<StackTop*>(self);
  Py_CLEAR(top->local);
  Py_CLEAR(top->fallback);
  return 0;
}

PyType_Slot stack_top_slots[] = {
    {Py_tp_doc, const_cast<char*>("The state of a native md.get_replica_context (replica_context_getter).")},
    {Py_tp_dealloc, reinterpret_cast<void*>(stack_top_dealloc)},
    {Py_tp_traverse, reinterpret_cast<void*>(stack_top_traverse)},
    {Py_tp_clear, reinterpret_cast<void*>(stack_top_clear)},
    {0, nullptr}};

PyType_Spec stack_top_spec = {"mirrored._core._StackTop", sizeof(StackTop), 0,
                              Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, stack_top_slots};

PyMethodDef get_replica_context_def = {
    "get_replica_context", stack_top_replica_context, METH_NOARGS,
    "get_replica_context()\n--\n\nThe replica context of this thread; None in cross-replica context; a default one "
    "outside any strategy."};

// replica_context_getter(local, name, fallback): get_replica_context as a builtin (see the method table).
PyObject* replica_context_getter(PyObject*, PyObject* args) {
  PyObject *local, *name, *fallback;
  if (!PyArg_ParseTuple(args, "OUO:replica_context_getter", &local, &name, &fallback)) return nullptr;
  auto* top = PyObject_GC_New(StackTop, stack_top_type);
  if (!top) return nullptr;
  top->local = Py_NewRef(local);
  top->name = Py_NewRef(name);
  top->fallback = Py_NewRef(fallback);
  PyObject_GC_Track(top);
  PyObject* module = PyObject_GetAttrString(fallback, "__module__");  // (the getter's module: the fallback's)
  PyObject* fn =
      module ? PyCFunction_NewEx(&get_replica_context_def, reinterpret_cast<PyObject*>(top), module) : nullptr;
  Py_XDECREF(module);
  Py_DECREF(top);
  return fn;
}

// ReplicaContext.all_reduce: a repeated call (the op's name the latest call's, no options, one array of the
// replicas' own type or NumPy's) goes straight to the exchange, as the Python method's first branch does;
// every other call is that method's (`slow`, ReplicaContext._all_reduce), which keeps the latest call.
struct {
  PyObject* slow = nullptr;       // ReplicaContext._all_reduce
  PyObject* op_type = nullptr;    // ReduceOp (its members name their op by `_value_`)
  PyObject* ndarray = nullptr;    // numpy.ndarray
  PyObject* latest = nullptr;     // interned attribute names
  PyObject* array_type = nullptr;
  PyObject* group = nullptr;
  PyObject* replica = nullptr;
  PyObject* value = nullptr;
  PyObject* exchange = nullptr;
  PyObject* kind = nullptr;       // "all_reduce"
} all_reduce_parts;

PyObject* replica_all_reduce(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  auto& p = all_reduce_parts;
  if (!kwnames && (nargs == 2 || (nargs == 3 && args[2] == Py_None))) {
    PyObject* name = args[0];
    if (Py_TYPE(name) == reinterpret_cast<PyTypeObject*>(p.op_type)) name = PyObject_GetAttr(name, p.value);
    else Py_INCREF(name);
    if (!name) return nullptr;
    PyObject* latest = PyObject_GetAttr(self, p.latest);  // (op name, combine) of the latest call
    PyObject* combine = latest && PyTuple_CheckExact(latest) && PyTuple_GET_SIZE(latest) == 2 &&
                        PyTuple_GET_ITEM(latest, 0) == name && PyUnicode_CheckExact(name)
                        ? PyTuple_GET_ITEM(latest, 1) : nullptr;
    Py_DECREF(name);
    PyObject* result = nullptr;
    bool done = !latest;
    if (combine && combine != Py_None) {
      PyObject* value = args[1];
      PyObject* own = PyObject_GetAttr(self, p.array_type);
      if (!own) {
        done = true;
      } else if (reinterpret_cast<PyObject*>(Py_TYPE(value)) == own ||
                 reinterpret_cast<PyObject*>(Py_TYPE(value)) == p.ndarray) {
        PyObject* group = PyObject_GetAttr(self, p.group);
        PyObject* rid = group ? PyObject_GetAttr(self, p.replica) : nullptr;
        if (rid) {
          PyObject* call[6] = {group, rid, p.kind, value, combine, self};
          result = PyObject_VectorcallMethod(p.exchange, call, 6 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
        }
        Py_XDECREF(rid);
        Py_XDECREF(group);
        done = true;
      }
      Py_XDECREF(own);
    }
    Py_XDECREF(latest);
    if (done) return result;
  }
  // (Every other call: the Python method, with the same arguments.)
  const Py_ssize_t total = nargs + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0);
  PyObject* small[8];
  std::vector<PyObject*> large;
  PyObject** call = small;
  if (total + 1 > 8) {
    large.resize(total + 1);
    call = large.data();
  }
  call[0] = self;
  std::copy(args, args + total, call + 1);
  return PyObject_Vectorcall(p.slow, call, nargs + 1, kwnames);
}

PyMethodDef all_reduce_def = {
    "all_reduce", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(replica_all_reduce)),
    METH_FASTCALL | METH_KEYWORDS,
    "all_reduce($self, reduce_op, value, options=None)\n--\n\nReduce ``value`` (an array or a nested structure of "
    "arrays) across replicas; all get the result.\n\nAll leaves go through one fused batch all-reduce of the "
    "strategy's cross-device ops. ``options``: this call's ``CommunicationOptions``, merged over the strategy's "
    "(docs/multi_worker.md)."};

// replica_all_reduce_method(cls, slow, op_type, ndarray): ReplicaContext.all_reduce (see all_reduce_parts).
PyObject* replica_all_reduce_method(PyObject*, PyObject* args) {
  PyObject *cls, *slow, *op_type, *ndarray;
  if (!PyArg_ParseTuple(args, "O!OO!O!:replica_all_reduce_method", &PyType_Type, &cls, &slow, &PyType_Type, &op_type,
                        &PyType_Type, &ndarray))
    return nullptr;
  auto& p = all_reduce_parts;
  for (auto [field, value] : {std::pair{&p.slow, slow}, {&p.op_type, op_type}, {&p.ndarray, ndarray}})
    Py_XSETREF(*field, Py_NewRef(value));
  for (auto [field, text] : {std::pair{&p.latest, "_latest"}, {&p.array_type, "_array_type"}, {&p.group, "_group"},
                             {&p.replica, "_local_replica_id"}, {&p.value, "_value_"}, {&p.exchange, "exchange"},
                             {&p.kind, "all_reduce"}})
    if (!*field && !(*field = PyUnicode_InternFromString(text))) return nullptr;
  return PyDescr_NewMethod(reinterpret_cast<PyTypeObject*>(cls), &all_reduce_def);
}

PyMethodDef module_functions[] = {
    {"replica_context_getter", replica_context_getter, METH_VARARGS,
     "replica_context_getter(local, name, fallback): md.get_replica_context as a builtin: the replica context of the "
     "top entry of `local.<name>` (this thread's context stack of (strategy, replica context) tuples), else "
     "fallback()."},
    {"replica_all_reduce_method", replica_all_reduce_method, METH_VARARGS,
     "replica_all_reduce_method(cls, slow, op_type, ndarray): cls.all_reduce as a method descriptor: a repeated call "
     "(the latest call's op name, no options, one array of cls._array_type or ndarray) goes straight to "
     "self._group.exchange; every other call is slow(self, ...)."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

int add_rendezvous(PyObject* module) {
  for (auto [target, text] : {std::pair{&str_combine, "combine"}, {&str_step, "_step"}, {&str_device_id, "device_id"},
                              {&str_ptr, "ptr"}, {&str_arrived, "_arrived"}, {&str_foreign, "_foreign"},
                              {&str_any_foreign, "_any_foreign"}, {&str_arrival_parts, "arrival_parts"},
                              {&str_parent, "parent"}, {&str_scope, "scope"}, {&str_entry, "_entry"},
                              {&str_ordinal, "_ordinal"}, {&str_enter, "__enter__"}, {&str_exit, "__exit__"},
                              {&str_use, "use"}, {&str_dict, "__dict__"}, {&str_pending, "pending"},
                              {&str_finish, "finish"}, {&str_stream, "_stream"}, {&str_device, "_device"},
                              {&str_require_current, "_require_current"}, {&str_record, "record"},
                              {&str_wait_event, "wait_event"}}) {
    *target = PyUnicode_InternFromString(text);
    if (!*target) return -1;
  }
  PyObject* top = PyType_FromSpec(&stack_top_spec);
  if (!top) return -1;
  stack_top_type = reinterpret_cast<PyTypeObject*>(top);  // (kept for the process: getters made by the module hold it)
  if (PyModule_AddFunctions(module, module_functions) < 0) return -1;
  PyObject* type = PyType_FromSpec(&rv_spec);
  if (!type) return -1;
  rendezvous_type = reinterpret_cast<PyTypeObject*>(type);  // (the module keeps it)
  if (PyModule_AddObject(module, "Rendezvous", type) < 0) {
    Py_DECREF(type);
    return -1;
  }
  return 0;
}

}  // namespace mirrored::bindings
