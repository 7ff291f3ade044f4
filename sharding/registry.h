// Internal: which module is which model's FSDP unit, so that UnitForward can find it.
#pragma once

namespace torch::nn {
class Module;
}

namespace fsdp {

class FsdpModel;
class FsdpUnit;

struct UnitEntry {
  FsdpModel* model = nullptr;
  FsdpUnit* unit = nullptr;
};

void RegisterUnit(const torch::nn::Module* module, UnitEntry entry);
void UnregisterUnit(const torch::nn::Module* module);
// {nullptr, nullptr} when `module` is not a unit.
UnitEntry LookupUnit(const torch::nn::Module* module);

}  // namespace fsdp
