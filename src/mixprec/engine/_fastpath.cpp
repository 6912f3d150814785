// mixprec's kernels at the Autocast keys, in C++: the commonest call decided without Python.
//
// ``_fastpath.py`` builds this file on first use and registers one ``Kernel`` per overload on top of the Python
// kernel ``_kernels`` registered at the same key. A call takes the fast path when all of these hold:
//
//   - this thread's table for the device is known: its mixprec setting's (a ``Table``, pushed by
//     ``_state.ActiveSettings``), or with no setting torch's native categories (``native``, ``holders``);
//   - the table's plan for the overload is a plain cast (``CAST``: the target dtype, or the region's, and
//     whether weights go through the cast cache) or none at all (``THROUGH``: torch's fallthrough);
//   - the call is in forward (no autograd graph task), with no saved-tensor hooks and grad mode on,
//     inference_mode or a plain no_grad (``outside_checkpoints``), so that no checkpoint has to record it;
//   - no key of a tracer, a Python mode or a functorch transform is in the call's key set, and no torch.func
//     transform is running (``functorch_active``: the call may be another op's piece).
//
// Everything else calls the Python kernel, the one implementation of every rule; the fast path repeats only
// ``_rules.runner``'s cast and ``_plan``'s eligibility test, and a test holds it to the Python kernel op by op.
// The weights' cast caches live here, for both kinds of kernel (``_cast`` reaches them from Python).

#include <torch/csrc/utils/pybind.h>  // (not torch/extension.h: all of libtorch's C++ API, 24 s to build instead of 16)

#include <ATen/SavedTensorHooks.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/AutogradState.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/library.h>

#include <torch/csrc/Dtype.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace {

enum Kind : int8_t { SLOW = 0, THROUGH = 1, CAST = 2 };

struct Plan {
  int8_t kind = SLOW;
  int8_t dtype = -1;  // a c10::ScalarType, or -1: the region's dtype
  bool cached = false;  // weights go through the cast cache
  bool torch_rules = false;  // an op run as native: its weights' casts follow torch's cache rules (the mirror)
};

// A setting's plans, indexed by the overloads' kernel numbers (a number past the end: SLOW).
struct Table {
  std::vector<Plan> plans;
};

constexpr size_t kDevices = 8;
// Per device slot: this thread's setting's table, and the process's table of torch's native categories (for
// a thread with no setting; null while mixprec.install is in force). Native tables are kept for the life of
// the process, so a reader never sees one freed. A thread's table counts only if it was set in the current
// epoch (``synced``). A thread Python has not told of its setting since the kernels came (or came back after
// ``_kernels.reset``, which starts a new epoch) takes the native table if it held no mixprec state when they
// came (``holders``: it has no setting, and any it makes later is told); one that held some might have a
// setting, so its calls go to Python until it is told.
thread_local std::array<std::shared_ptr<const Table>, kDevices> active;
thread_local std::array<uint64_t, kDevices> synced{};
std::atomic<uint64_t> epoch{1};
// The threads (``threading.get_ident``) that held mixprec state when the kernels came (``set_holders``); null
// until Python says, so that every thread not told counts as one. Each thread reads it once per generation.
std::mutex holders_lock;
std::shared_ptr<const std::unordered_set<unsigned long>> holders;
std::atomic<uint64_t> holders_generation{1};
thread_local uint64_t holder_checked = 0;
thread_local bool holder_here = true;
std::array<std::atomic<const Table*>, kDevices> native{};
std::mutex native_lock;
std::atomic<bool> enabled{true};  // false: every call goes to the Python kernel (``_fastpath.suspended``)
// This thread's calls taken by the C++ kernels and handed to Python (for tests and ``_fastpath.counts``).
thread_local int64_t fast_calls = 0;
thread_local int64_t python_calls = 0;
std::vector<std::shared_ptr<const Table>> native_kept;

c10::DispatchKeySet slow_keys() {
  // A call with any of these goes to the Python kernel: it traces, or runs a Python mode or a transform.
  c10::DispatchKeySet keys;
  for (auto k : {c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot, c10::DispatchKey::PythonDispatcher,
                 c10::DispatchKey::PreDispatch, c10::DispatchKey::Functionalize, c10::DispatchKey::Tracer,
                 c10::DispatchKey::FuncTorchDynamicLayerFrontMode, c10::DispatchKey::FuncTorchDynamicLayerBackMode,
                 c10::DispatchKey::FuncTorchGradWrapper, c10::DispatchKey::FuncTorchBatched,
                 c10::DispatchKey::FuncTorchVmapMode, c10::DispatchKey::BatchedNestedTensor,
                 c10::DispatchKey::Batched, c10::DispatchKey::VmapMode}) {
    keys = keys | c10::DispatchKeySet(k);
  }
  return keys;
}

// The dtypes autocast may cast from, as ``_plan.eligible`` says (``set_eligible``; floating point, not float64).
std::array<bool, static_cast<size_t>(c10::ScalarType::NumOptions)> castable{};

bool eligible(const at::Tensor& t, at::ScalarType dtype, c10::DeviceType device) {
  // ``_plan.eligible_tensor`` (a castable dtype, on the device) and not already ``dtype``.
  auto source = t.scalar_type();
  return source != dtype && castable[static_cast<size_t>(source)] && t.device().type() == device;
}

// Whether a call's arguments are cast last to first, as torch's own kernels cast them (``set_reversed``:
// ``_compat.native_casts_reversed``), so autograd sums a tensor's gradients in native's order.
bool reversed_order = true;

bool is_weight(const at::Tensor& t) {
  // ``_cast.cast_call``'s test for a cast the cache keeps: a float32 leaf that requires grad, not a view.
  return t.scalar_type() == at::kFloat && t.requires_grad() && t.is_leaf() && !t.is_view();
}

// The cast caches, for both kinds of kernel (the Python kernels reach them through ``_cast``, which calls the
// functions at the end of this file). A key is the weight's TensorImpl, held weakly as torch's own cache holds
// it: the address is not reused while an entry holds a weak reference to it, so a live entry is the weight's.
//
// - ``own``: a thread's cache inside a mixprec level (``in_level``: told by ``_cast.levels_changed`` and
//   ``set_active``): keyed by weight and dtype, an entry valid while the weight's version counter is unchanged,
//   cleared when the thread's outermost level closes, not used while grad mode is off.
// - ``mirror``: everywhere else, with torch's rules: process-wide, keyed by the weight alone (answering
//   whatever dtype it holds), used under no_grad too with the copy made with grad on, cleared with torch's.
//   An op a policy changes or emulates, outside any mixprec level (a checkpoint's recompute, ``install``),
//   keeps its casts there too but keyed by weight and dtype (``exact``), out of sight of an op run as native.
using Weak = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

struct OwnKey {
  c10::TensorImpl* weight;
  int8_t dtype;
  bool operator==(const OwnKey& other) const { return weight == other.weight && dtype == other.dtype; }
};

struct OwnKeyHash {
  size_t operator()(const OwnKey& k) const {
    return std::hash<const void*>()(k.weight) ^ static_cast<size_t>(static_cast<uint8_t>(k.dtype));
  }
};

struct OwnEntry {
  Weak weight;
  int64_t version;  // (Tensor::_version()'s type)
  at::Tensor cast;
};

using OwnMap = std::unordered_map<OwnKey, OwnEntry, OwnKeyHash>;

struct OwnCache {
  OwnMap map;
  // A thread that ends with entries left hands them to the process: destroying a tensor that has a Python
  // object needs the interpreter, which a thread's exit (or the process's) may have gone past.
  ~OwnCache() {
    if (!map.empty()) new OwnMap(std::move(map));
  }
};

struct MirrorEntry {
  Weak weight;
  at::Tensor cast;
};

using MirrorMap = std::unordered_map<OwnKey, MirrorEntry, OwnKeyHash>;  // dtype -1: torch's rule (any dtype)

thread_local OwnCache own;
thread_local bool in_level = false;
std::mutex mirror_lock;
MirrorMap& mirror = *new MirrorMap();  // never destroyed, for the same reason

bool alive_as(const Weak& ref, const at::Tensor& weight) {
  return !ref.expired() && ref._unsafe_get_target() == weight.unsafeGetTensorImpl();
}

at::Tensor cast_own(const at::Tensor& weight, at::ScalarType dtype) {
  const OwnKey key{weight.unsafeGetTensorImpl(), static_cast<int8_t>(dtype)};
  auto found = own.map.find(key);
  if (found != own.map.end() && alive_as(found->second.weight, weight) &&
      found->second.version == weight._version()) {
    return found->second.cast;
  }
  at::Tensor out = weight.to(dtype);
  OwnEntry entry{Weak(weight.getIntrusivePtr()), weight._version(), out};
  if (found != own.map.end()) {
    std::swap(found->second, entry);  // the stale entry goes with ``entry``
  } else {
    own.map.emplace(key, std::move(entry));
  }
  return out;
}

at::Tensor cast_mirror(const at::Tensor& weight, at::ScalarType dtype, bool exact) {
  std::optional<MirrorEntry> stale;  // released after the lock: its tensor may have a Python object to free
  const OwnKey key{weight.unsafeGetTensorImpl(), exact ? static_cast<int8_t>(dtype) : static_cast<int8_t>(-1)};
  std::lock_guard<std::mutex> hold(mirror_lock);
  auto found = mirror.find(key);
  if (found != mirror.end() && alive_as(found->second.weight, weight)) return found->second.cast;
  at::Tensor out;
  {
    c10::AutoGradMode on(true);  // torch's copy carries autograd history under no_grad too
    out = weight.to(dtype);
  }
  MirrorEntry entry{Weak(weight.getIntrusivePtr()), out};
  if (found != mirror.end()) {
    stale.emplace(std::move(found->second));
    found->second = std::move(entry);
  } else {
    mirror.emplace(key, std::move(entry));
  }
  return out;
}

// ``_cast.cast_weight`` for a call in forward with no trace: for an op run as native (``torch_rules``), the
// mirror; for another, inside a mixprec level, the thread's own cache while grad is on and none under no_grad,
// and outside one the mirror's exact entries.
at::Tensor cast_cached(const at::Tensor& weight, at::ScalarType dtype, bool torch_rules) {
  if (c10::InferenceMode::is_enabled()) return weight.to(dtype);  // an inference tensor: never kept (as torch)
  if (torch_rules) return cast_mirror(weight, dtype, false);
  if (!in_level) return cast_mirror(weight, dtype, true);
  if (!at::GradMode::is_enabled()) return weight.to(dtype);
  return cast_own(weight, dtype);
}

at::Tensor cast_one(const at::Tensor& t, at::ScalarType dtype, c10::DeviceType device, bool cache,
                    bool torch_rules) {
  if (!eligible(t, dtype, device)) return t;
  if (cache && is_weight(t)) return cast_cached(t, dtype, torch_rules);
  return t.to(dtype);
}

// Whether this thread held mixprec state when the kernels came (or Python has not said yet).
bool held_state() {
  if (holder_checked != holders_generation.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> hold(holders_lock);
    holder_here = !holders || holders->count(PyThread_get_thread_ident()) > 0;
    holder_checked = holders_generation.load();
  }
  return holder_here;
}

// Whether no checkpoint can need the call recorded (the Python kernel looks for a reentrant one's forward when
// grad mode is off). Grad on: none can. Under inference_mode nothing is recomputed (what it makes never enters
// an autograd graph). Grad off (no_grad): none can unless in the forward of a custom autograd Function, which
// turns forward-mode grad off (those go to Python).
bool outside_checkpoints() {
  if (at::GradMode::is_enabled() || c10::InferenceMode::is_enabled()) return true;
  return c10::AutogradState::get_tls_state().get_fw_grad_mode();
}

// Whether a torch.func transform is running (its dynamic-layer keys in the thread's included set, as
// torch._C._are_functorch_transforms_active tests): the call may be a piece of another op that the transform
// broke up above the Autocast key, which the Python kernel decides on (``_rules.transform_guard``).
bool functorch_active() {
  const c10::DispatchKeySet included = c10::impl::tls_local_dispatch_key_set().included_;
  return included.has(c10::DispatchKey::FuncTorchDynamicLayerFrontMode) ||
         included.has(c10::DispatchKey::FuncTorchDynamicLayerBackMode);
}

struct Kernel final : c10::OperatorKernel {
  Kernel(int64_t number, size_t slot, c10::DeviceType device, c10::DispatchKey key, c10::SafeKernelFunction python)
      : number(number),
        slot(slot),
        device(device),
        key(key),
        after(c10::DispatchKeySet::FULL_AFTER, key),
        avoid(slow_keys()),
        python(std::move(python)) {}

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
    const bool told = synced[slot] == epoch.load(std::memory_order_acquire);
    const Table* table = told ? active[slot].get() : nullptr;
    if (table == nullptr && (told || !held_state())) table = native[slot].load(std::memory_order_acquire);
    if (table == nullptr || static_cast<size_t>(number) >= table->plans.size() ||
        !enabled.load(std::memory_order_relaxed)) {
      ++python_calls;
      return python.callBoxed(op, ks, stack);
    }
    const Plan plan = table->plans[number];
    if (plan.kind == SLOW || !(ks & avoid).empty() || torch::autograd::get_current_graph_task_id() >= 0 ||
        !outside_checkpoints() || !at::SavedTensorDefaultHooks::get_tls_state().stack.empty() || functorch_active()) {
      ++python_calls;
      return python.callBoxed(op, ks, stack);
    }
    ++fast_calls;
    if (plan.kind == THROUGH) {
      return op.redispatchBoxed(ks & after, stack);
    }
    // As the Python runner: the casts and the op with the Autocast key excluded.
    c10::impl::ExcludeDispatchKeyGuard guard(key);
    const auto dtype = plan.dtype >= 0 ? static_cast<at::ScalarType>(plan.dtype) : at::autocast::get_autocast_dtype(device);
    const bool cache = plan.cached && at::autocast::is_autocast_cache_enabled();
    const auto n = static_cast<std::ptrdiff_t>(op.schema().arguments().size());
    const auto first = stack->end() - n;
    for (std::ptrdiff_t i = 0; i < n; ++i) {
      c10::IValue& value = *(reversed_order ? stack->end() - 1 - i : first + i);
      if (value.isTensor()) {
        value = cast_one(value.toTensor(), dtype, device, cache, plan.torch_rules);
      } else if (value.isTensorList()) {
        const auto list = value.toTensorList();
        c10::List<at::Tensor> out;
        out.reserve(list.size());
        for (const at::Tensor& t : list) out.push_back(cast_one(t, dtype, device, cache, plan.torch_rules));
        value = std::move(out);
      } else if (value.isList()) {
        const auto list = value.toList();
        c10::impl::GenericList out(list.elementType());
        out.reserve(list.size());
        for (const c10::IValue& item : list) {
          out.push_back(
              item.isTensor() ? c10::IValue(cast_one(item.toTensor(), dtype, device, cache, plan.torch_rules)) : item);
        }
        value = std::move(out);
      }
    }
    op.callBoxed(stack);
  }

  int64_t number;
  size_t slot;
  c10::DeviceType device;
  c10::DispatchKey key;
  c10::DispatchKeySet after;
  c10::DispatchKeySet avoid;
  c10::SafeKernelFunction python;
};

// Drops the warning torch gives when a kernel at a key is overridden (putting one on top is what ``attach`` is
// for, and the Python registration below it filters the same warning); passes any other on.
struct OverrideWarningFilter : c10::WarningHandler {
  explicit OverrideWarningFilter(c10::WarningHandler* next) : next(next) {}
  void process(const c10::Warning& warning) override {
    if (warning.msg().find("previously registered kernel") == std::string::npos) next->process(warning);
  }
  c10::WarningHandler* next;
};

// One overload's C++ kernel, registered on top of its Python kernel; dropping it takes the C++ kernel away.
struct Registration {
  std::unique_ptr<torch::Library> library;
};

std::shared_ptr<Registration> attach(const std::string& name, const std::string& overload, const std::string& key_name,
                                     int64_t number, int64_t slot, const std::string& device) {
  // None where the dispatcher has no schema for the overload (``aten::index_put.hacked_twin``: TorchScript's own,
  // with a kernel but no schema): its Python kernel serves it alone.
  const auto key = c10::parseDispatchKey(key_name);
  const auto found = c10::Dispatcher::singleton().findSchema(c10::OperatorName(name, overload));
  if (!found.has_value()) return nullptr;
  const auto& op = *found;
  auto python = op.getComputedKernelForDispatchKey(key);
  const auto ns = name.substr(0, name.find("::"));
  const auto bare = name.substr(name.find("::") + 2);
  auto reg = std::make_shared<Registration>();
  reg->library = std::make_unique<torch::Library>(torch::Library::IMPL, ns, key, __FILE__, __LINE__);
  const std::string full = overload.empty() || overload == "default" ? bare : bare + "." + overload;
  OverrideWarningFilter filter(c10::WarningUtils::get_warning_handler());
  c10::WarningUtils::WarningHandlerGuard quiet(&filter);
  reg->library->impl(full.c_str(),
                     torch::CppFunction::makeFromBoxedFunctor(std::make_unique<Kernel>(
                         number, static_cast<size_t>(slot), c10::Device(device).type(), key, std::move(python))));
  return reg;
}

// A torch.dtype's scalar type (Python hands dtypes to plans, ``set_eligible`` and the casts).
at::ScalarType scalar_type(const pybind11::object& dtype) {
  TORCH_CHECK(THPDtype_Check(dtype.ptr()), "mixprec: expected a torch.dtype");
  return reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type;
}

std::shared_ptr<Table> make_table(const std::vector<std::tuple<int64_t, pybind11::object, bool, bool>>& plans) {
  // (kind, target dtype or None for the region's, cached, torch's cache rules) per overload number.
  auto table = std::make_shared<Table>();
  table->plans.reserve(plans.size());
  for (const auto& [kind, dtype, cached, torch_rules] : plans) {
    int8_t target = -1;
    if (!dtype.is_none()) {
      target = static_cast<int8_t>(scalar_type(dtype));
    }
    table->plans.push_back(Plan{static_cast<int8_t>(kind), target, cached, torch_rules});
  }
  return table;
}

void set_native(int64_t slot, std::shared_ptr<Table> table) {
  TORCH_CHECK(slot >= 0 && static_cast<size_t>(slot) < kDevices, "mixprec: no fast-path slot ", slot);
  std::lock_guard<std::mutex> hold(native_lock);
  if (table && std::find(native_kept.begin(), native_kept.end(), table) == native_kept.end()) {
    native_kept.push_back(table);
  }
  native[slot].store(table.get(), std::memory_order_release);
}

void set_active(int64_t slot, std::shared_ptr<Table> table, bool level) {
  // ``level``: whether the thread has a mixprec level open (which cache its weights' casts go through).
  TORCH_CHECK(slot >= 0 && static_cast<size_t>(slot) < kDevices, "mixprec: no fast-path slot ", slot);
  active[slot] = std::move(table);
  in_level = level;
  synced[slot] = epoch.load();
}

// The caches as ``_cast`` sees them. ``(weight or None if it is gone, dtype or None, version or None, cast)``
// per entry; the own cache is the calling thread's.
pybind11::list own_entries() {
  pybind11::list out;
  for (const auto& [key, entry] : own.map) {
    auto weight = entry.weight.lock();
    out.append(pybind11::make_tuple(
        weight ? pybind11::cast(at::Tensor(std::move(weight))) : pybind11::none(),
        pybind11::handle(reinterpret_cast<PyObject*>(torch::getTHPDtype(static_cast<at::ScalarType>(key.dtype)))),
        entry.version, entry.cast));
  }
  return out;
}

pybind11::list mirror_entries() {
  std::vector<std::tuple<int8_t, Weak, at::Tensor>> copy;
  {
    pybind11::gil_scoped_release free;  // (another thread may hold the lock and need the interpreter)
    std::lock_guard<std::mutex> hold(mirror_lock);
    for (const auto& [key, entry] : mirror) copy.emplace_back(key.dtype, entry.weight, entry.cast);
  }
  pybind11::list out;
  for (auto& [dtype, ref, cast] : copy) {
    auto weight = ref.lock();
    out.append(pybind11::make_tuple(
        weight ? pybind11::cast(at::Tensor(std::move(weight))) : pybind11::none(),
        dtype < 0 ? pybind11::none()
                  : pybind11::reinterpret_borrow<pybind11::object>(
                        reinterpret_cast<PyObject*>(torch::getTHPDtype(static_cast<at::ScalarType>(dtype)))),
        pybind11::none(), cast));
  }
  return out;
}

void own_clear() {
  OwnMap gone;
  std::swap(gone, own.map);
}

void mirror_clear() {
  MirrorMap gone;
  {
    pybind11::gil_scoped_release free;
    std::lock_guard<std::mutex> hold(mirror_lock);
    std::swap(gone, mirror);
  }
}

size_t mirror_size() {
  pybind11::gil_scoped_release free;
  std::lock_guard<std::mutex> hold(mirror_lock);
  return mirror.size();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<Table, std::shared_ptr<Table>>(m, "Table");
  pybind11::class_<Registration, std::shared_ptr<Registration>>(m, "Registration");
  m.def("attach", &attach);
  m.def("make_table", &make_table);
  m.def("set_active", &set_active);
  m.def("set_native", &set_native);
  m.def("set_enabled", [](bool on) { enabled.store(on); });
  m.def("new_epoch", []() {
    std::lock_guard<std::mutex> hold(holders_lock);
    holders.reset();
    holders_generation.fetch_add(1);
    epoch.fetch_add(1);
  });
  m.def("set_holders", [](const std::vector<unsigned long>& idents) {
    auto made = std::make_shared<const std::unordered_set<unsigned long>>(idents.begin(), idents.end());
    std::lock_guard<std::mutex> hold(holders_lock);
    holders = std::move(made);
    holders_generation.fetch_add(1);
  });
  m.def("set_eligible", [](const std::vector<pybind11::object>& dtypes) {
    castable.fill(false);
    for (const auto& d : dtypes) {
      castable[static_cast<size_t>(scalar_type(d))] = true;
    }
  });
  m.def("set_reversed", [](bool on) { reversed_order = on; });
  m.def("counts", []() { return std::make_tuple(fast_calls, python_calls); });
  m.def("set_in_level", [](bool on) { in_level = on; });
  // The casts run without the GIL, as torch's own calls do (and a thread that holds the mirror's lock may
  // need the GIL to free a tensor's Python object).
  m.def("cast_own", [](const at::Tensor& weight, const pybind11::object& dtype) {
    const auto target = scalar_type(dtype);
    pybind11::gil_scoped_release free;
    return cast_own(weight, target);
  });
  m.def("cast_mirror", [](const at::Tensor& weight, const pybind11::object& dtype) {
    const auto target = scalar_type(dtype);
    pybind11::gil_scoped_release free;
    return cast_mirror(weight, target, false);
  });
  m.def("cast_exact", [](const at::Tensor& weight, const pybind11::object& dtype) {
    const auto target = scalar_type(dtype);
    pybind11::gil_scoped_release free;
    return cast_mirror(weight, target, true);
  });
  m.def("own_entries", &own_entries);
  m.def("own_size", []() { return own.map.size(); });
  m.def("own_clear", &own_clear);
  m.def("mirror_entries", &mirror_entries);
  m.def("mirror_size", &mirror_size);
  m.def("mirror_clear", &mirror_clear);
}
