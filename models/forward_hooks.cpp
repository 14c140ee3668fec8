#include "models/forward_hooks.h"

#include <atomic>
#include <memory>
#include <mutex>
#include <unordered_map>

namespace models {
namespace {

// A hook and the module it was set on: a module owned by a shared_ptr is
// held weakly, so a hook never outlives its module (another module that
// later gets the same address finds the entry expired).
struct Entry {
  ForwardHook hook;
  std::weak_ptr<const torch::nn::Module> module;
  bool owned = false;  // module was held by a shared_ptr when the hook was set
};

struct HookRegistry {
  std::mutex mu;
  std::unordered_map<const torch::nn::Module*, Entry> hooks;
  std::atomic<size_t> count{0};  // lets the common case (no hooks) skip the lock
};

HookRegistry& registry() {
  static HookRegistry r;
  return r;
}

}  // namespace

void set_forward_hook(const torch::nn::Module& module, ForwardHook hook) {
  HookRegistry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  // Entries of modules that died since (their hooks may hold resources,
  // e.g. tensor parallelism's process groups) go now.
  for (auto it = r.hooks.begin(); it != r.hooks.end();) {
    it = it->second.owned && it->second.module.expired() ? r.hooks.erase(it) : std::next(it);
  }
  if (!hook) {
    r.hooks.erase(&module);
  } else {
    Entry& e = r.hooks[&module];
    e.hook = std::move(hook);
    e.module = module.weak_from_this();
    e.owned = !e.module.expired();
  }
  r.count = r.hooks.size();
}

void clear_forward_hook(const torch::nn::Module& module) { set_forward_hook(module, {}); }

namespace {

// The live hook of `module`, dropping an entry left by a dead module at the
// same address. REQUIRES: r.mu held.
const ForwardHook* live_hook(HookRegistry& r, const torch::nn::Module& module) {
  auto it = r.hooks.find(&module);
  if (it == r.hooks.end()) return nullptr;
  if (it->second.owned && it->second.module.expired()) {
    r.hooks.erase(it);
    r.count = r.hooks.size();
    return nullptr;
  }
  return &it->second.hook;
}

}  // namespace

bool has_forward_hook(const torch::nn::Module& module) {
  HookRegistry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return live_hook(r, module) != nullptr;
}

torch::Tensor call_with_hook(const torch::nn::Module& module, const torch::Tensor& input,
                             const ModuleFn& fn) {
  HookRegistry& r = registry();
  if (r.count.load(std::memory_order_acquire) == 0) return fn(input);
  ForwardHook hook;
  {
    std::lock_guard<std::mutex> lock(r.mu);
    const ForwardHook* live = live_hook(r, module);
    if (live == nullptr) return fn(input);
    hook = *live;
  }
  return hook(input, fn);
}

namespace {

std::atomic<UnitHook> unit_hook{nullptr};

}  // namespace

void set_unit_hook(UnitHook hook) { unit_hook.store(hook, std::memory_order_release); }

torch::Tensor run_unit(const torch::nn::Module& unit, const UnitFn& fn) {
  const UnitHook hook = unit_hook.load(std::memory_order_acquire);
  return hook != nullptr ? hook(unit, fn) : fn();
}

}  // namespace models
