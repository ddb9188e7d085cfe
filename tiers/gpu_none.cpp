// gpu.h for builds without CUDA: no device, every call says so.
#include "tiers/gpu.h"

namespace strata::gpu {

static Status NoCuda() { return UnsupportedError("this build of Strata has no CUDA"); }

int DeviceCount(std::string* why) {
  if (why) *why = "built without CUDA";
  return 0;
}
bool Available() { return false; }
uint64_t DeviceMemoryBytes(int) { return 0; }
std::string DeviceName(int) { return ""; }
Status SetDevice(int) { return NoCuda(); }
Result<void*> Malloc(uint64_t) { return NoCuda(); }
Status Free(void*) { return NoCuda(); }
Status HostRegister(void*, uint64_t) { return NoCuda(); }
Status HostUnregister(void*) { return NoCuda(); }
int NumaNodeOfDevice(int) { return -1; }
Result<Stream> StreamCreate() { return NoCuda(); }
Status StreamDestroy(Stream) { return NoCuda(); }
Status MemcpyAsync(void*, const void*, uint64_t, bool, Stream) { return NoCuda(); }
Status StreamSynchronize(Stream) { return NoCuda(); }
Result<Event> EventRecord(Stream) { return NoCuda(); }
Status EventSynchronize(Event) { return NoCuda(); }
bool EventQuery(Event) { return true; }

}  // namespace strata::gpu
