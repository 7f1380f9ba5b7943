#include "engine/nixl_agent.h"

#include <dlfcn.h>
#include <sys/stat.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "core/log.h"

namespace m3::engine {

// Our declarations of the NIXL C API functions used (ai-dynamo/nixl, the C API its Rust binding
// wraps; status 0 success, 1 in progress, negative errors; handles are opaque pointers).
namespace {
using St = int;
using H = void*;
constexpr int kMemDram = 0;
constexpr int kOpRead = 0;
constexpr St kInProgress = 1;
}  // namespace

struct NixlApi {
  St (*create_agent)(const char*, H*);
  St (*destroy_agent)(H);
  St (*get_available_plugins)(H, H*);
  St (*string_list_size)(H, size_t*);
  St (*string_list_get)(H, size_t, const char**);
  St (*destroy_string_list)(H);
  St (*get_plugin_params)(H, const char*, H*, H*);
  St (*destroy_mem_list)(H);
  St (*destroy_params)(H);
  St (*create_backend)(H, const char*, H, H*);
  St (*destroy_backend)(H);
  St (*create_reg_dlist)(int, H*);
  St (*reg_dlist_add_desc)(H, uintptr_t, size_t, uint64_t, const void*, size_t);
  St (*destroy_reg_dlist)(H);
  St (*register_mem)(H, H, H);
  St (*deregister_mem)(H, H, H);
  St (*get_local_md)(H, void**, size_t*);
  St (*load_remote_md)(H, const void*, size_t, char**);
  St (*invalidate_remote_md)(H, const char*);
  St (*create_xfer_dlist)(int, H*);
  St (*xfer_dlist_add_desc)(H, uintptr_t, size_t, uint64_t);
  St (*destroy_xfer_dlist)(H);
  St (*create_opt_args)(H*);
  St (*opt_args_set_notif_msg)(H, const void*, size_t);
  St (*opt_args_set_has_notif)(H, bool);
  St (*destroy_opt_args)(H);
  St (*create_xfer_req)(H, int, H, H, const char*, H*, H);
  St (*post_xfer_req)(H, H, H);
  St (*get_xfer_status)(H, H);
  St (*release_xfer_req)(H, H);
  St (*destroy_xfer_req)(H);
  St (*create_notif_map)(H*);
  St (*destroy_notif_map)(H);
  St (*get_notifs)(H, H, H);
  St (*notif_map_size)(H, size_t*);
  St (*notif_map_get_agent_at)(H, size_t, const char**);
  St (*notif_map_get_notifs_size)(H, const char*, size_t*);
  St (*notif_map_get_notif)(H, const char*, size_t, const void**, size_t*);
};

namespace {

const char kInstallHint[] =
    "install NIXL with `pip install nixl-cu13` (or nixl-cu12) for the python3 on PATH, or set "
    "M3_NIXL_LIB to its libnixl_capi.so";

bool is_dir(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

// The wheel's library: <site-packages>/.nixl_cu13.mesonpy.libs/libnixl_capi.so, found from the
// package that python3 finds (find_spec only: importing it would load its Python deps).
std::string library_from_python() {
  const char* cmd =
      "python3 -c \"import importlib.util as u, os\n"
      "for m in ('nixl_cu13', 'nixl_cu12'):\n"
      "    s = u.find_spec(m)\n"
      "    if s and s.submodule_search_locations:\n"
      "        d = os.path.dirname(list(s.submodule_search_locations)[0])\n"
      "        p = os.path.join(d, '.' + m + '.mesonpy.libs', 'libnixl_capi.so')\n"
      "        if os.path.exists(p):\n"
      "            print(p)\n"
      "            break\" 2>/dev/null";
  FILE* f = ::popen(cmd, "r");
  if (f == nullptr) return "";
  std::array<char, 4096> buf{};
  std::string out;
  while (std::fgets(buf.data(), buf.size(), f) != nullptr) out += buf.data();
  ::pclose(f);
  while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
  return out;
}

std::mutex g_load_mu;
NixlApi g_api;
bool g_loaded = false;
std::string g_path;

Result<const NixlApi*> load_api() {
  std::lock_guard<std::mutex> lock(g_load_mu);
  if (g_loaded) return &g_api;
  std::string path;
  if (const char* env = std::getenv("M3_NIXL_LIB"); env != nullptr && *env != '\0') {
    path = env;
    if (is_dir(path)) path += "/libnixl_capi.so";
  } else {
    path = library_from_python();
    if (path.empty()) {
      return make_error(
          ErrorCode::kUnsupported,
          std::string("NixlConnector needs NIXL, which was not found: ") + kInstallHint,
          "--kv-transfer-config");
    }
  }
  // The UCX plugin sits next to the library in the wheel; NIXL reads NIXL_PLUGIN_DIR.
  const std::string dir = path.substr(0, path.find_last_of('/') + 1);
  if (std::getenv("NIXL_PLUGIN_DIR") == nullptr && is_dir(dir + "plugins"))
    ::setenv("NIXL_PLUGIN_DIR", (dir + "plugins").c_str(), 0);
  void* lib = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = ::dlerror();
    return make_error(
        ErrorCode::kUnsupported,
        "NixlConnector: cannot load " + path + " (" + (why ? why : "?") + "); " + kInstallHint,
        "--kv-transfer-config");
  }
  std::string missing;
  auto sym = [&](auto& fn, const char* name) {
    void* p = ::dlsym(lib, name);
    if (p == nullptr) missing += (missing.empty() ? "" : ", ") + std::string(name);
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
  };
  NixlApi& a = g_api;
  sym(a.create_agent, "nixl_capi_create_agent");
  sym(a.destroy_agent, "nixl_capi_destroy_agent");
  sym(a.get_available_plugins, "nixl_capi_get_available_plugins");
  sym(a.string_list_size, "nixl_capi_string_list_size");
  sym(a.string_list_get, "nixl_capi_string_list_get");
  sym(a.destroy_string_list, "nixl_capi_destroy_string_list");
  sym(a.get_plugin_params, "nixl_capi_get_plugin_params");
  sym(a.destroy_mem_list, "nixl_capi_destroy_mem_list");
  sym(a.destroy_params, "nixl_capi_destroy_params");
  sym(a.create_backend, "nixl_capi_create_backend");
  sym(a.destroy_backend, "nixl_capi_destroy_backend");
  sym(a.create_reg_dlist, "nixl_capi_create_reg_dlist");
  sym(a.reg_dlist_add_desc, "nixl_capi_reg_dlist_add_desc");
  sym(a.destroy_reg_dlist, "nixl_capi_destroy_reg_dlist");
  sym(a.register_mem, "nixl_capi_register_mem");
  sym(a.deregister_mem, "nixl_capi_deregister_mem");
  sym(a.get_local_md, "nixl_capi_get_local_md");
  sym(a.load_remote_md, "nixl_capi_load_remote_md");
  sym(a.invalidate_remote_md, "nixl_capi_invalidate_remote_md");
  sym(a.create_xfer_dlist, "nixl_capi_create_xfer_dlist");
  sym(a.xfer_dlist_add_desc, "nixl_capi_xfer_dlist_add_desc");
  sym(a.destroy_xfer_dlist, "nixl_capi_destroy_xfer_dlist");
  sym(a.create_opt_args, "nixl_capi_create_opt_args");
  sym(a.opt_args_set_notif_msg, "nixl_capi_opt_args_set_notif_msg");
  sym(a.opt_args_set_has_notif, "nixl_capi_opt_args_set_has_notif");
  sym(a.destroy_opt_args, "nixl_capi_destroy_opt_args");
  sym(a.create_xfer_req, "nixl_capi_create_xfer_req");
  sym(a.post_xfer_req, "nixl_capi_post_xfer_req");
  sym(a.get_xfer_status, "nixl_capi_get_xfer_status");
  sym(a.release_xfer_req, "nixl_capi_release_xfer_req");
  sym(a.destroy_xfer_req, "nixl_capi_destroy_xfer_req");
  sym(a.create_notif_map, "nixl_capi_create_notif_map");
  sym(a.destroy_notif_map, "nixl_capi_destroy_notif_map");
  sym(a.get_notifs, "nixl_capi_get_notifs");
  sym(a.notif_map_size, "nixl_capi_notif_map_size");
  sym(a.notif_map_get_agent_at, "nixl_capi_notif_map_get_agent_at");
  sym(a.notif_map_get_notifs_size, "nixl_capi_notif_map_get_notifs_size");
  sym(a.notif_map_get_notif, "nixl_capi_notif_map_get_notif");
  if (!missing.empty()) {
    ::dlclose(lib);
    return make_error(ErrorCode::kUnsupported,
                      "NixlConnector: " + path + " lacks " + missing +
                          " (a NIXL C API older or newer than 1.5?); install nixl-cu13 1.5",
                      "--kv-transfer-config");
  }
  g_loaded = true;  // never unloaded: agents may live until exit
  g_path = path;
  return &g_api;
}

tl::unexpected<Error> fail(const std::string& what, St st) {
  return make_error(ErrorCode::kIo, "NIXL " + what + " failed (status " + std::to_string(st) + ")");
}

}  // namespace

std::string NixlAgent::library_path() {
  std::lock_guard<std::mutex> lock(g_load_mu);
  return g_path;
}

Result<std::unique_ptr<NixlAgent>> NixlAgent::create(const std::string& name) {
  M3_TRY(const NixlApi* api, load_api());
  std::unique_ptr<NixlAgent> a(new NixlAgent());
  a->api_ = api;
  if (St st = api->create_agent(name.c_str(), &a->agent_); st != 0 || a->agent_ == nullptr)
    return fail("create_agent", st);
  H plugins = nullptr;
  bool has_ucx = false;
  std::string names;
  if (api->get_available_plugins(a->agent_, &plugins) == 0 && plugins != nullptr) {
    size_t n = 0;
    api->string_list_size(plugins, &n);
    for (size_t i = 0; i < n; ++i) {
      const char* s = nullptr;
      if (api->string_list_get(plugins, i, &s) == 0 && s != nullptr) {
        has_ucx = has_ucx || std::strcmp(s, "UCX") == 0;
        names += (names.empty() ? "" : ", ") + std::string(s);
      }
    }
    api->destroy_string_list(plugins);
  }
  if (!has_ucx) {
    return make_error(ErrorCode::kUnsupported,
                      "NixlConnector: NIXL (" + library_path() + ") has no UCX plugin (found: " +
                          (names.empty() ? std::string("none") : names) +
                          "); set NIXL_PLUGIN_DIR to the folder holding libplugin_UCX.so",
                      "--kv-transfer-config");
  }
  H mems = nullptr, params = nullptr;
  if (St st = api->get_plugin_params(a->agent_, "UCX", &mems, &params); st != 0)
    return fail("get_plugin_params(UCX)", st);
  const St st = api->create_backend(a->agent_, "UCX", params, &a->backend_);
  if (mems) api->destroy_mem_list(mems);
  if (params) api->destroy_params(params);
  if (st != 0) return fail("create_backend(UCX)", st);
  return a;
}

NixlAgent::~NixlAgent() {
  if (api_ == nullptr) return;
  for (H d : registered_) {
    api_->deregister_mem(agent_, d, nullptr);
    api_->destroy_reg_dlist(d);
  }
  if (agent_ != nullptr) api_->destroy_agent(agent_);  // owns its backends
}

Status NixlAgent::register_dram(std::span<const NixlDesc> regions) {
  std::lock_guard<std::mutex> lock(mu_);
  H d = nullptr;
  if (St st = api_->create_reg_dlist(kMemDram, &d); st != 0) return fail("create_reg_dlist", st);
  for (const NixlDesc& r : regions) api_->reg_dlist_add_desc(d, r.addr, r.bytes, 0, nullptr, 0);
  if (St st = api_->register_mem(agent_, d, nullptr); st != 0) {
    api_->destroy_reg_dlist(d);
    return fail("register_mem", st);
  }
  registered_.push_back(d);
  return {};
}

Result<std::string> NixlAgent::local_metadata() {
  std::lock_guard<std::mutex> lock(mu_);
  void* data = nullptr;
  size_t len = 0;
  if (St st = api_->get_local_md(agent_, &data, &len); st != 0) return fail("get_local_md", st);
  std::string md(static_cast<const char*>(data), len);
  std::free(data);
  return md;
}

Result<std::string> NixlAgent::load_remote(const std::string& metadata) {
  std::lock_guard<std::mutex> lock(mu_);
  char* name = nullptr;
  if (St st = api_->load_remote_md(agent_, metadata.data(), metadata.size(), &name); st != 0)
    return fail("load_remote_md", st);
  std::string out = name ? name : "";
  std::free(name);
  return out;
}

void NixlAgent::forget_remote(const std::string& agent) {
  std::lock_guard<std::mutex> lock(mu_);
  api_->invalidate_remote_md(agent_, agent.c_str());
}

Result<void*> NixlAgent::start_read(std::span<const NixlDesc> local,
                                    std::span<const NixlDesc> remote,
                                    const std::string& remote_agent, const std::string& notif) {
  std::lock_guard<std::mutex> lock(mu_);
  H ld = nullptr, rd = nullptr, opt = nullptr, req = nullptr;
  auto cleanup = [&] {
    if (ld) api_->destroy_xfer_dlist(ld);
    if (rd) api_->destroy_xfer_dlist(rd);
    if (opt) api_->destroy_opt_args(opt);
  };
  St st = api_->create_xfer_dlist(kMemDram, &ld);
  if (st == 0) st = api_->create_xfer_dlist(kMemDram, &rd);
  if (st == 0) st = api_->create_opt_args(&opt);
  if (st != 0) {
    cleanup();
    return fail("create descriptor lists", st);
  }
  for (const NixlDesc& d : local) api_->xfer_dlist_add_desc(ld, d.addr, d.bytes, 0);
  for (const NixlDesc& d : remote) api_->xfer_dlist_add_desc(rd, d.addr, d.bytes, 0);
  api_->opt_args_set_notif_msg(opt, notif.data(), notif.size());
  api_->opt_args_set_has_notif(opt, true);
  st = api_->create_xfer_req(agent_, kOpRead, ld, rd, remote_agent.c_str(), &req, opt);
  if (st == 0) {
    st = api_->post_xfer_req(agent_, req, nullptr);
    if (st < 0) {
      api_->release_xfer_req(agent_, req);
      api_->destroy_xfer_req(req);
      req = nullptr;
    }
  }
  cleanup();
  if (req == nullptr) return fail("READ from " + remote_agent, st);
  return static_cast<void*>(req);
}

int NixlAgent::status(void* xfer) {
  std::lock_guard<std::mutex> lock(mu_);
  const St st = api_->get_xfer_status(agent_, xfer);
  return st == kInProgress ? 1 : (st == 0 ? 0 : (st < 0 ? st : -100));
}

void NixlAgent::release(void* xfer) {
  std::lock_guard<std::mutex> lock(mu_);
  api_->release_xfer_req(agent_, xfer);
  api_->destroy_xfer_req(xfer);
}

std::vector<std::string> NixlAgent::take_notifications() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> out;
  H map = nullptr;
  if (api_->create_notif_map(&map) != 0) return out;
  if (api_->get_notifs(agent_, map, nullptr) == 0) {
    size_t n = 0;
    api_->notif_map_size(map, &n);
    for (size_t i = 0; i < n; ++i) {
      const char* agent = nullptr;
      if (api_->notif_map_get_agent_at(map, i, &agent) != 0 || agent == nullptr) continue;
      size_t k = 0;
      api_->notif_map_get_notifs_size(map, agent, &k);
      for (size_t j = 0; j < k; ++j) {
        const void* data = nullptr;
        size_t len = 0;
        if (api_->notif_map_get_notif(map, agent, j, &data, &len) == 0 && data != nullptr)
          out.emplace_back(static_cast<const char*>(data), len);
      }
    }
  }
  api_->destroy_notif_map(map);
  return out;
}

}  // namespace m3::engine
