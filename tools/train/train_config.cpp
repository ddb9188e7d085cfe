// The built-in config, --config merged over it, and the facts the trainer
// reads back from the merged result (swap folders, stage, gradient reduction).
#include "tools/train/train_config.h"

#include <stdlib.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

namespace strata::train {
namespace {

using Json = nlohmann::json;

void ApplyStrataFlags(const ConfigInputs& in, Json& j);

Json BuiltinConfig(const ConfigInputs& in) {
  Json j = {{"optimizer",
             {{"type", "AdamW"},
              {"params",
               {{"lr", in.lr}, {"betas", {0.9, 0.95}}, {"eps", 1e-8}, {"weight_decay", in.weight_decay}}}}},
            {"gradient_clipping", in.clip},
            {"zero_optimization", {{"stage", 3}, {"stage3_prefetch_bucket_size", 2e6}}},
            {"strata", {{"device_budget", in.device_budget}, {"host_budget", in.host_budget}}}};
  if (in.fp16)
    j["fp16"] = {{"enabled", true}, {"initial_scale_power", 12}};
  else
    j["bf16"] = {{"enabled", true}};
  if (!in.resident) {
    // Without --nvme the folder is filled in after the merge, only if --config names none.
    Json offload = {{"device", "nvme"}};
    if (!in.nvme.empty()) offload["nvme_path"] = in.nvme;
    j["zero_optimization"]["offload_optimizer"] = offload;
    j["zero_optimization"]["offload_param"] = offload;
  } else {
    j["strata"]["device_budget"] = "auto";
    j["strata"]["host_budget"] = "auto";
  }
  ApplyStrataFlags(in, j);  // --trace, --state-format, --offload-activations
  return j;
}

bool MergeFile(const std::string& path, Json* j, std::string* error) {
  std::ifstream f(path);
  if (!f) {
    *error = "cannot read --config " + path;
    return false;
  }
  try {
    j->merge_patch(Json::parse(f));
  } catch (const std::exception& e) {
    *error = "--config " + path + ": " + e.what();
    return false;
  }
  return true;
}

// j[key] when j is an object that has it, else null. Never throws: the
// engine, not this file, reports keys of the wrong type.
Json* Member(Json& j, const char* key) {
  if (!j.is_object()) return nullptr;
  auto it = j.find(key);
  return it == j.end() ? nullptr : &*it;
}

std::string Lower(const Json* v) {
  if (v == nullptr || !v->is_string()) return "";
  std::string s = v->get<std::string>();
  std::transform(s.begin(), s.end(), s.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

// A key the engine reads as absent: missing, "" or "auto".
bool Unset(const Json* v) {
  return v == nullptr || (v->is_string() && (Lower(v).empty() || Lower(v) == "auto"));
}

// --offload-activations (the store's sizes follow the model), --trace and
// --state-format. Applied to the built-in config, and after --config's
// merge whatever the file removed (ApplyGivenFlags has already made the
// flags given win over the file's keys; the activation store's sizes the
// file gives are kept): a "strata" it made "auto" or null (the engine's
// default section) still gets what the flags ask for. A non-object is left
// for the engine to refuse, naming it.
void ApplyStrataFlags(const ConfigInputs& in, Json& j) {
  if (in.offload_activations.empty() && in.trace.empty() && in.state_format.empty()) return;
  if (Json* s = Member(j, "strata"); s == nullptr || s->is_null() || Unset(s)) j["strata"] = Json::object();
  Json& strata = j["strata"];
  if (!strata.is_object()) return;
  auto set = [&](const char* key, const Json& v) {
    if (!strata.contains(key)) strata[key] = v;
  };
  // --trace and --state-format, given, as well (the budgets' defaults are
  // the trainer's, not flags: a section removed takes the engine's).
  if (!in.trace.empty()) set("trace_path", in.trace);
  if (!in.state_format.empty()) set("state_format", in.state_format);
  if (in.offload_activations.empty()) return;
  // Each stash takes its size rounded to 4 KiB (and to the swap's stripes: 64 KiB covers 16 folders).
  const uint64_t item = (in.activation_bytes + 65535) / 65536 * 65536;
  const uint64_t all = item * std::max<uint64_t>(in.activation_count, 1);
  if (in.offload_activations == "host") {
    set("activation_host_bytes", all);
  } else {  // an arena of two stashes: one on its way to or from the disk, one read ahead
    set("activation_host_bytes", 2 * item);
    set("activation_prefetch_bytes", item);
    set("activation_nvme_bytes", all);
  }
}

void AddOnce(std::vector<std::string>* list, const std::string& s) {
  if (std::find(list->begin(), list->end(), s) == list->end()) list->push_back(s);
}

// strata.nvme_paths when it is a non-empty list: it serves every offloaded section.
std::vector<std::string> NvmePathsList(Json& j) {
  std::vector<std::string> out;
  Json* strata = Member(j, "strata");
  Json* list = strata ? Member(*strata, "nvme_paths") : nullptr;
  if (list == nullptr || !list->is_array()) return out;
  for (const Json& item : *list)
    if (item.is_string()) AddOnce(&out, item.get<std::string>());
  return out;
}

// --nvme, or a fresh folder under /var/tmp made on first need (removed at the end).
bool SwapFolder(const ConfigInputs& in, TrainConfig* out, std::string* dir, std::string* error) {
  if (!in.nvme.empty()) {
    *dir = in.nvme;
    return true;
  }
  if (out->own_swap.empty()) {
    char tmpl[] = "/var/tmp/strata-train-XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) {
      *error = "cannot create a swap folder under /var/tmp (give one with --nvme)";
      return false;
    }
    out->own_swap = tmpl;
  }
  *dir = out->own_swap;
  return true;
}

// Gives each offloaded section without a folder --nvme, or a fresh one under
// /var/tmp (made on first need), and lists the folders the swap files go to.
bool ResolveSwapFolders(const ConfigInputs& in, Json& j, TrainConfig* out, std::string* error) {
  const std::vector<std::string> shared = NvmePathsList(j);
  Json* zero = Member(j, "zero_optimization");
  for (const char* name : {"offload_param", "offload_optimizer"}) {
    Json* section = zero ? Member(*zero, name) : nullptr;
    if (section == nullptr || Lower(Member(*section, "device")) != "nvme") continue;
    if (!shared.empty()) {
      for (const auto& d : shared) AddOnce(&out->swap_folders, d);
      continue;
    }
    if (Unset(Member(*section, "nvme_path"))) {
      std::string dir;
      if (!SwapFolder(in, out, &dir, error)) return false;
      (*section)["nvme_path"] = dir;
    }
    const Json* path = Member(*section, "nvme_path");
    if (path->is_string()) AddOnce(&out->swap_folders, path->get<std::string>());
  }
  // --offload-activations nvme with no state on NVMe: the activations' folder.
  if (in.offload_activations == "nvme" && out->swap_folders.empty()) {
    std::string dir;
    if (!SwapFolder(in, out, &dir, error)) return false;
    // (ApplyStrataFlags made "strata" an object, unless --config made it another non-object.)
    if (Json* strata = Member(j, "strata"); strata && strata->is_object()) (*strata)["nvme_paths"] = Json::array({dir});
    out->swap_folders.push_back(dir);
  }
  return true;
}

// The peak learning rate: --lr where given (a config's other lr is noted),
// else the merged optimizer.params.lr ("auto" or none: --lr's default).
bool ResolveLr(const ConfigInputs& in, Json& j, TrainConfig* out, std::string* error) {
  out->lr = in.lr;
  Json* opt = Member(j, "optimizer");
  Json* params = opt ? Member(*opt, "params") : nullptr;
  Json* lr = params ? Member(*params, "lr") : nullptr;
  if (Unset(lr) || lr->is_null()) return true;
  if (!lr->is_number() || !std::isfinite(lr->get<double>()) || lr->get<double>() < 0) {
    if (in.lr_given) return true;  // --lr's value is used; the engine names the config's bad one
    *error = "--config: optimizer.params.lr must be a finite number >= 0 (or \"auto\"), not " + lr->dump();
    return false;
  }
  const double v = lr->get<double>();
  if (!in.lr_given) {
    out->lr = v;
  } else if (v != in.lr) {
    char note[160];
    std::snprintf(note, sizeof note, "--lr %g overrides --config's optimizer.params.lr %g", in.lr, v);
    out->notes.push_back(note);
    *lr = in.lr;
  }
  return true;
}

// at[key] := v for a flag given on the command line, noting where --config
// had another value there (`path` names the key as the file spells it).
void Override(Json& at, const char* key, const Json& v, const std::string& flag, const std::string& path,
              TrainConfig* out) {
  if (Json* had = Member(at, key); had != nullptr && *had != v)
    out->notes.push_back(flag + " overrides --config's " + path + " " + had->dump());
  at[key] = v;
}

// j[key] as an object (made one where absent, null or "auto"); null when the
// file made it another non-object (the engine refuses that, naming it).
Json* Section(Json& j, const char* key) {
  if (!j.is_object()) return nullptr;
  Json* s = Member(j, key);
  if (s == nullptr || s->is_null() || Unset(s)) {
    j[key] = Json::object();
    s = &j[key];
  }
  return s->is_object() ? s : nullptr;
}

// The flags given win over --config's keys: the budgets, --nvme, --fp16,
// --resident, --trace and --state-format (--lr: ResolveLr).
void ApplyGivenFlags(const ConfigInputs& in, Json& j, TrainConfig* out) {
  const bool strata_flags = in.device_budget_given || in.host_budget_given || in.resident || !in.trace.empty() ||
                            !in.state_format.empty() || !in.nvme.empty();
  if (Json* strata = strata_flags ? Section(j, "strata") : nullptr) {
    if (in.device_budget_given) Override(*strata, "device_budget", in.device_budget, "--device-budget", "strata.device_budget", out);
    if (in.host_budget_given) Override(*strata, "host_budget", in.host_budget, "--host-budget", "strata.host_budget", out);
    if (in.resident) {
      Override(*strata, "device_budget", "auto", "--resident", "strata.device_budget", out);
      Override(*strata, "host_budget", "auto", "--resident", "strata.host_budget", out);
    }
    if (!in.trace.empty()) Override(*strata, "trace_path", in.trace, "--trace", "strata.trace_path", out);
    if (!in.state_format.empty())
      Override(*strata, "state_format", in.state_format, "--state-format", "strata.state_format", out);
    // (An empty list, as strata-plan --write-config writes it, names no folder.)
    if (const Json* paths = Member(*strata, "nvme_paths"); !in.nvme.empty() && paths != nullptr && paths->is_array() &&
                                                           !paths->empty())
      Override(*strata, "nvme_paths", Json::array({in.nvme}), "--nvme", "strata.nvme_paths", out);
  }
  if (in.fp16) {
    if (Json* fp16 = Section(j, "fp16")) Override(*fp16, "enabled", true, "--fp16", "fp16.enabled", out);
    for (const char* name : {"bf16", "bfloat16"})  // (the engine reads either spelling)
      if (Json* bf16 = Member(j, name); bf16 != nullptr && bf16->is_object())
        Override(*bf16, "enabled", false, "--fp16", std::string(name) + ".enabled", out);
  }
  Json* zero = Member(j, "zero_optimization");
  if (zero == nullptr || !zero->is_object()) return;
  for (const char* name : {"offload_param", "offload_optimizer"}) {
    const std::string path = std::string("zero_optimization.") + name;
    if (in.resident) {
      if (Json* sec = Member(*zero, name); sec != nullptr && sec->is_object() && Lower(Member(*sec, "device")) != "none")
        Override(*sec, "device", "none", "--resident", path + ".device", out);
      continue;
    }
    Json* sec = Member(*zero, name);
    if (!in.nvme.empty() && sec != nullptr && sec->is_object() && Lower(Member(*sec, "device")) == "nvme" &&
        !Unset(Member(*sec, "nvme_path")))
      Override(*sec, "nvme_path", in.nvme, "--nvme", path + ".nvme_path", out);
  }
}

// Every built-in value --config changed (a leaf of `base` that differs in, or
// is gone from, `j`), said in a note: strata-train's defaults (clipping 1.0,
// betas (0.9, 0.95), bf16, ...) are not what a config written for another
// trainer, or strata-plan's --write-config, keeps.
void NoteChanges(const Json& base, const Json& j, const std::string& path, TrainConfig* out) {
  if (base.is_object() && j.is_object()) {
    for (auto it = base.begin(); it != base.end(); ++it) {
      auto there = j.find(it.key());
      const std::string p = path.empty() ? it.key() : path + "." + it.key();
      if (there == j.end()) out->notes.push_back("--config removes strata-train's " + p + " " + it.value().dump());
      else NoteChanges(it.value(), *there, p, out);
    }
    return;
  }
  // (Names the engine reads in any case, "AdamW" and "adamw", are the same.)
  if (base.is_string() && j.is_string() && Lower(&base) == Lower(&j)) return;
  if (base != j) out->notes.push_back("--config changes strata-train's " + path + " " + base.dump() + " to " + j.dump());
}

// What strata-train does not do, asked for by --config: refused, naming it
// (the engine leaves these keys to the trainer, and strata-train is it).
bool CheckTrainerKeys(const ConfigInputs& in, Json& j, std::string* error) {
  auto count = [&](const char* key, int64_t want, const char* flag) {
    const Json* v = Member(j, key);
    if (Unset(v) || v->is_null()) return true;
    if (v->is_number() && v->get<double>() == static_cast<double>(want)) return true;
    *error = std::string("--config's ") + key + " " + v->dump() + ": strata-train " + flag;
    return false;
  };
  if (!count("train_batch_size", in.batch, ("takes " + std::to_string(in.batch) + " sequences a step from --batch (or the preset); give --batch instead").c_str()))
    return false;
  if (!count("train_micro_batch_size_per_gpu", in.local_batch, ("trains " + std::to_string(in.local_batch) + " sequences a rank a step (--batch over the ranks); give --batch instead").c_str()))
    return false;
  if (!count("gradient_accumulation_steps", 1, "takes one micro-batch a step (no gradient accumulation); give a larger --batch instead"))
    return false;
  if (const Json* sched = Member(j, "scheduler"); sched != nullptr && !sched->is_null() && !Unset(sched)) {
    *error = "--config's scheduler: strata-train runs its own schedule (--warmup steps of linear warm-up to the peak lr, "
             "then cosine decay to a tenth of it); remove the scheduler section";
    return false;
  }
  return true;
}

}  // namespace

bool MakeTrainConfig(const ConfigInputs& in, TrainConfig* out, std::string* error) {
  Json j = BuiltinConfig(in);
  const Json base = j;
  if (!in.config_path.empty()) {
    if (!MergeFile(in.config_path, &j, error)) return false;
    if (!CheckTrainerKeys(in, j, error)) return false;
    ApplyGivenFlags(in, j, out);
  }
  ApplyStrataFlags(in, j);
  if (!ResolveSwapFolders(in, j, out, error)) return false;
  if (!ResolveLr(in, j, out, error)) return false;
  if (!in.config_path.empty()) NoteChanges(base, j, "", out);
  Json* zero = Member(j, "zero_optimization");
  const Json* stage = zero ? Member(*zero, "stage") : nullptr;
  out->stage = Unset(stage) ? 0 : stage->is_number_integer() ? stage->get<int>() : -1;
  Json* strata = Member(j, "strata");
  out->grad_sum = strata && Lower(Member(*strata, "grad_reduce")) == "sum";
  out->compact = strata && Lower(Member(*strata, "state_format")) == "compact";
  if (!in.lead && strata && strata->is_object()) strata->erase("trace_path");  // one rank writes reports
  out->json = j.dump();
  return true;
}

}  // namespace strata::train
