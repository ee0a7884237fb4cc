// mirrored._core.Rendezvous: the rendezvous of a strategy.run's replicas
// (python/mirrored/distribute/distribute_lib.py `_Group` is this type) and the
// cooperative scheduler of the replicas that run as greenlets on the run's
// caller's thread (python/mirrored/distribute/mirrored_strategy.py).
//
// Why native: a collective inside strategy.run costs, per replica, an arrival,
// a park and a resume. In Python each of those is several frames (about 18 us
// for 4 replicas, four times the all-reduce itself); here each is one call
// (docs/architecture.md, "Replica hand-offs", has the numbers).
//
// Every field is read and written with the GIL held and no Python code runs
// between a check and the update it guards, so the GIL alone serialises the
// replicas on threads and the greenlets; the only lock is the one a replica on
// a thread of its own sleeps on, with the GIL released. The combine and the
// greenlet switches are Python calls: a field they may change is read again
// after them.
#include "bindings/rendezvous_binding.h"

#include <chrono>
#include <condition_variable>
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
  PyObject* aborted_type = nullptr;  // distribute_lib._Aborted
  PyObject* tracing = nullptr;       // () -> whether the timeline records (mirrored.timeline.enabled)
  PyObject* traced = nullptr;        // (group, rid, kind, payload, combine) -> exchange inside a timeline span

  // The cooperative scheduler (set once by cooperate(); hub set per run by reset()).
  PyObject* next_replica = nullptr;   // () -> index of a replica the caller claimed, or None
  PyObject* run_replica = nullptr;    // (index) -> runs that replica to its end
  PyObject* state = nullptr;          // an object with save()/restore(saved), or null with state_locals
  std::vector<PyObject*> state_locals;  // (object, name, default) triples read and set directly
  PyObject* body = nullptr;           // the greenlets' run function: (rendezvous, index)
  PyObject* greenlet_type = nullptr;
  PyObject* getcurrent = nullptr;
  PyObject* switch_fn = nullptr;      // greenlet.greenlet.switch
  PyObject* hub = nullptr;            // the run's caller's greenlet; null: this run is not cooperative
  PyObject* idle = nullptr;           // the hub's thread's idle greenlets (a list)
  PyObject* replicas = nullptr;       // the run's greenlet replicas (a set)
  std::vector<PyObject*> parked;      // greenlet replicas waiting in the collective under way
  std::deque<PyObject*> ready;        // greenlet replicas a combine (or an abort) released
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

PyObject* str_arrive;  // interned "arrive", "combine", "save", "restore", "parent"
PyObject* str_combine;
PyObject* str_save;
PyObject* str_restore;
PyObject* str_parent;

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

PyObject* run_combine(State* s, PyObject* combine, PyObject* slots) {
  if (s->order) return PyObject_CallMethodObjArgs(s->order, str_combine, combine, slots, nullptr);
  return PyObject_CallOneArg(combine, slots);
}

// The last replica to arrive: one combine for all. Returns a new reference to its results, or to the
// exception it raised (every replica raises it; the run reports it once).
PyObject* combine_all(State* s, PyObject* combine) {
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
      results = run_combine(s, combine, slots);
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

int switch_ready(State* s) {  // resumes the first ready replica
  PyObject* g = s->ready.front();
  s->ready.pop_front();
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
    PyObject* index = PyObject_CallNoArgs(s->next_replica);
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

PyObject* save_state(State* s) {
  if (s->state) return PyObject_CallMethodNoArgs(s->state, str_save);
  const Py_ssize_t count = static_cast<Py_ssize_t>(s->state_locals.size() / 3);
  PyObject* saved = PyTuple_New(count);
  for (Py_ssize_t i = 0; saved && i < count; ++i) {
    PyObject* value = PyObject_GetAttr(s->state_locals[3 * i], s->state_locals[3 * i + 1]);
    if (!value && PyErr_ExceptionMatches(PyExc_AttributeError)) {
      PyErr_Clear();
      value = s->state_locals[3 * i + 2];
      Py_INCREF(value);
    }
    if (!value) Py_CLEAR(saved);
    else PyTuple_SET_ITEM(saved, i, value);
  }
  return saved;
}

int restore_state(State* s, PyObject* saved) {
  if (s->state) {
    PyObject* r = PyObject_CallMethodOneArg(s->state, str_restore, saved);
    Py_XDECREF(r);
    return r ? 0 : -1;
  }
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(saved); ++i)
    if (PyObject_SetAttr(s->state_locals[3 * i], s->state_locals[3 * i + 1], PyTuple_GET_ITEM(saved, i)) < 0)
      return -1;
  return 0;
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
// makes it ready and someone resumes it. Its thread-local state goes and comes back with it.
PyObject* wait(State* s, PyObject* self, long generation, PyObject* me, Waiter waiter) {
  PyObject* saved = save_state(s);
  if (!saved) return nullptr;
  PyObject* results = nullptr;
  for (;;) {
    if (waiter == kHub) {
      if (serve(s, self, generation) < 0) break;
    } else {
      PyObject* index = PyObject_CallNoArgs(s->next_replica);
      if (!index) break;
      int rc;
      if (index != Py_None) {
        rc = start(s, self, index);
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

// Replica `rid` hands in `payload` for the collective `kind`; returns its part of combine's results.
PyObject* exchange(Rendezvous* self, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4) {
    PyErr_Format(PyExc_TypeError, "exchange(rid, kind, payload, combine) takes 4 arguments (%zd given)", nargs);
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
  if (s->order) {
    PyObject* r = PyObject_CallMethodObjArgs(s->order, str_arrive, args[0], nullptr);
    if (!r) return nullptr;
    Py_DECREF(r);
  }
  PyObject* results = nullptr;
  if (s->n == 1) {
    PyObject* slots = PyList_New(1);
    if (!slots) return nullptr;
    Py_INCREF(payload);
    PyList_SET_ITEM(slots, 0, payload);
    results = run_combine(s, combine, slots);
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
      results = combine_all(s, combine);
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
      results = wait(s, reinterpret_cast<PyObject*>(self), generation, me, waiter);
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
  PyObject* tracing = PyObject_CallNoArgs(s->tracing);
  if (!tracing) return nullptr;
  const int traced = PyObject_IsTrue(tracing);
  Py_DECREF(tracing);
  if (traced < 0) return nullptr;
  if (traced && nargs == 4) {  // the timeline records each replica's wait
    PyObject* call[5] = {self, args[0], args[1], args[2], args[3]};
    return PyObject_Vectorcall(s->traced, call, 5, nullptr);
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
  for (PyObject* g : s->parked) Py_DECREF(g);
  s->parked.clear();
  for (PyObject* g : s->ready) Py_DECREF(g);
  s->ready.clear();
  if (s->replicas) PySet_Clear(s->replicas);
  s->unfinished = 0;
}

PyObject* rv_reset(PyObject* self, PyObject* idle) {
  State* s = reinterpret_cast<Rendezvous*>(self)->s;
  clear_run(s);
  Py_CLEAR(s->hub);
  if (idle == Py_None) Py_RETURN_NONE;
  if (!s->getcurrent || !PyList_Check(idle)) {
    PyErr_SetString(PyExc_TypeError, "reset(idle): a list of idle greenlets needs cooperate() first; None: "
                                     "replicas on threads only");
    return nullptr;
  }
  s->hub = PyObject_CallNoArgs(s->getcurrent);
  if (!s->hub) return nullptr;
  Py_INCREF(idle);
  Py_XSETREF(s->idle, idle);
  if (s->unfinished || !s->parked.empty() || !s->ready.empty() || PySet_GET_SIZE(s->replicas))
    clear_cooperative(s);
  Py_RETURN_NONE;
}

PyObject* rv_cooperate(PyObject* self, PyObject* args) {
  State* s = reinterpret_cast<Rendezvous*>(self)->s;
  PyObject *next_replica, *run_replica, *state, *body, *greenlet;
  if (!PyArg_ParseTuple(args, "OOOOO:cooperate", &next_replica, &run_replica, &state, &body, &greenlet))
    return nullptr;
  std::vector<PyObject*> locals;
  if (PyTuple_Check(state)) {  // ((object, name, default), ...): read and set directly
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(state); ++i) {
      PyObject* triple = PyTuple_GET_ITEM(state, i);
      if (!PyTuple_Check(triple) || PyTuple_GET_SIZE(triple) != 3 || !PyUnicode_Check(PyTuple_GET_ITEM(triple, 1))) {
        PyErr_SetString(PyExc_TypeError, "state: expected (object, name, default) triples or an object with "
                                         "save() and restore(saved)");
        return nullptr;
      }
      for (int k = 0; k < 3; ++k) locals.push_back(Py_NewRef(PyTuple_GET_ITEM(triple, k)));
    }
  }
  PyObject* type = PyObject_GetAttrString(greenlet, "greenlet");
  PyObject* getcurrent = PyObject_GetAttrString(greenlet, "getcurrent");
  PyObject* switch_fn = type ? PyObject_GetAttrString(type, "switch") : nullptr;
  PyObject* replicas = PySet_New(nullptr);
  if (!type || !getcurrent || !switch_fn || !replicas) {
    Py_XDECREF(type);
    Py_XDECREF(getcurrent);
    Py_XDECREF(switch_fn);
    Py_XDECREF(replicas);
    for (PyObject* o : locals) Py_DECREF(o);
    return nullptr;
  }
  Py_XSETREF(s->next_replica, Py_NewRef(next_replica));
  Py_XSETREF(s->run_replica, Py_NewRef(run_replica));
  Py_XSETREF(s->state, PyTuple_Check(state) ? nullptr : Py_NewRef(state));
  for (PyObject* o : s->state_locals) Py_DECREF(o);
  s->state_locals = std::move(locals);
  Py_XSETREF(s->body, Py_NewRef(body));
  Py_XSETREF(s->greenlet_type, type);
  Py_XSETREF(s->getcurrent, getcurrent);
  Py_XSETREF(s->switch_fn, switch_fn);
  Py_XSETREF(s->replicas, replicas);
  Py_RETURN_NONE;
}

PyObject* rv_replica_finished(PyObject* self, PyObject*) {
  State* s = reinterpret_cast<Rendezvous*>(self)->s;
  ++s->finished;
  if (s->arrived && check_stranded(s) < 0) return nullptr;  // someone waits: is it stranded now?
  Py_RETURN_NONE;
}

PyObject* rv_abort(PyObject* self, PyObject*) {
  State* s = reinterpret_cast<Rendezvous*>(self)->s;
  if (!initialised(s)) return nullptr;
  if (!s->broken) {
    PyObject* exc = PyObject_CallNoArgs(s->aborted_type);
    if (!exc) return nullptr;
    Py_XSETREF(s->broken, exc);
  }
  notify(s);
  Py_RETURN_NONE;
}

PyObject* rv_run_replica(PyObject* self, PyObject* index) {
  PyObject* run_replica = reinterpret_cast<Rendezvous*>(self)->s->run_replica;
  if (!run_replica) {
    PyErr_SetString(PyExc_RuntimeError, "run_replica(): cooperate() first (it says how a replica runs)");
    return nullptr;
  }
  return PyObject_CallOneArg(run_replica, index);
}

// A greenlet replica returned: its greenlet goes back to the idle ones, and the thread on to a ready replica
// (a round trip through the hub saved), else to the hub. Returns what the greenlet's next start passes.
PyObject* rv_retire(PyObject* self, PyObject* g) {
  State* s = reinterpret_cast<Rendezvous*>(self)->s;
  if (!s->hub) {
    PyErr_SetString(PyExc_RuntimeError, "retire(): no cooperative run is under way");
    return nullptr;
  }
  --s->unfinished;
  if (PySet_Discard(s->replicas, g) < 0 || PyList_Append(s->idle, g) < 0) return nullptr;
  PyObject* target;
  if (!s->ready.empty()) {
    target = s->ready.front();
    s->ready.pop_front();
  } else {
    target = Py_NewRef(s->hub);
  }
  PyObject* r = switch_to(s, target);
  Py_DECREF(target);
  return r;
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
  static const char* names[] = {"n", "aborted", "tracing", "traced", nullptr};
  int n;
  PyObject *aborted, *tracing, *traced;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "iOOO:Rendezvous", const_cast<char**>(names), &n, &aborted, &tracing,
                                   &traced))
    return -1;
  if (n < 1) {
    PyErr_Format(PyExc_ValueError, "n=%d: a rendezvous needs at least one replica", n);
    return -1;
  }
  State* s = reinterpret_cast<Rendezvous*>(self)->s;
  clear_run(s);
  s->n = n;
  s->slots.assign(n, nullptr);
  s->kinds.assign(n, nullptr);
  Py_XSETREF(s->aborted_type, Py_NewRef(aborted));
  Py_XSETREF(s->tracing, Py_NewRef(tracing));
  Py_XSETREF(s->traced, Py_NewRef(traced));
  return 0;
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
  for (PyObject* o : {s->results, s->broken, s->order, s->aborted_type, s->tracing, s->traced, s->next_replica,
                      s->run_replica, s->state, s->body, s->greenlet_type, s->getcurrent, s->switch_fn, s->hub,
                      s->idle, s->replicas})
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
  for (PyObject** o : {&s->results, &s->broken, &s->order, &s->aborted_type, &s->tracing, &s->traced,
                       &s->next_replica, &s->run_replica, &s->state, &s->body, &s->greenlet_type, &s->getcurrent,
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

PyObject* rv_get_unfinished(PyObject* self, void*) {
  return PyLong_FromLong(reinterpret_cast<Rendezvous*>(self)->s->unfinished);
}

PyObject* rv_get_order(PyObject* self, void*) {
  PyObject* order = reinterpret_cast<Rendezvous*>(self)->s->order;
  return Py_NewRef(order ? order : Py_None);
}

int rv_set_order(PyObject* self, PyObject* value, void*) {
  State* s = reinterpret_cast<Rendezvous*>(self)->s;
  Py_XSETREF(s->order, value && value != Py_None ? Py_NewRef(value) : nullptr);
  return 0;
}

PyMethodDef rv_methods[] = {
    {"exchange", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(rv_exchange)), METH_FASTCALL,
     "exchange(rid, kind, payload, combine): replica rid's part of combine(every replica's payload), which the "
     "last replica to arrive runs; raises what broke the group."},
    {"_exchange", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(rv_exchange_untraced)), METH_FASTCALL,
     "exchange() without the timeline's check (the traced exchange runs it inside its span)."},
    {"reset", rv_reset, METH_O,
     "reset(idle): ready for a run; idle: the calling thread's idle greenlets (the caller runs replicas as "
     "greenlets), or None (replicas on threads only)."},
    {"cooperate", rv_cooperate, METH_VARARGS,
     "cooperate(next_replica, run_replica, state, body, greenlet): how the caller runs replicas as greenlets."},
    {"replica_finished", rv_replica_finished, METH_NOARGS, "A replica's function returned."},
    {"abort", rv_abort, METH_NOARGS, "Breaks the group (a replica failed): every waiting replica raises _Aborted."},
    {"run_replica", rv_run_replica, METH_O, "Runs replica `index` (on a greenlet)."},
    {"retire", rv_retire, METH_O, "retire(greenlet): its replica returned; hands the thread on."},
    {"drain", rv_drain, METH_NOARGS, "Resumes ready replicas until every greenlet replica returned."},
    {"finish_aborted", rv_finish_aborted, METH_NOARGS, "After an abort: lets every greenlet replica return."},
    {nullptr, nullptr, 0, nullptr}};

PyGetSetDef rv_getset[] = {
    {"n", rv_get_n, nullptr, "Replicas that meet.", nullptr},
    {"unfinished", rv_get_unfinished, nullptr, "Greenlet replicas started and not returned.", nullptr},
    {"order", rv_get_order, rv_set_order, "GPU replicas' MergeOrder, or None.", nullptr},
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

}  // namespace

int add_rendezvous(PyObject* module) {
  for (auto [target, text] : {std::pair{&str_arrive, "arrive"}, {&str_combine, "combine"},
                              {&str_save, "save"}, {&str_restore, "restore"}, {&str_parent, "parent"}}) {
    *target = PyUnicode_InternFromString(text);
    if (!*target) return -1;
  }
  PyObject* type = PyType_FromSpec(&rv_spec);
  if (!type) return -1;
  if (PyModule_AddObject(module, "Rendezvous", type) < 0) {
    Py_DECREF(type);
    return -1;
  }
  return 0;
}

}  // namespace mirrored::bindings
