// The few CUDA runtime calls the tiers need, behind plain functions so that
// a build without CUDA links, and a build with CUDA runs on a machine
// without a GPU: whether one is present is decided here, at run time.
#pragma once

#include <cstdint>
#include <string>

#include "base/status.h"

namespace strata::gpu {

// Number of usable GPUs; 0 when the runtime fails (no driver, "driver
// version is insufficient", no device), with the reason in `why`.
int DeviceCount(std::string* why = nullptr);
bool Available();
// Total memory of GPU `device` in bytes, 0 when unknown.
uint64_t DeviceMemoryBytes(int device);
// Its name ("NVIDIA H200"), "" when unknown.
std::string DeviceName(int device);
// Makes GPU `device` current on the calling thread (cudaSetDevice). The
// current device is per thread: every thread that allocates, copies or
// creates streams and events for a device calls this first. Without CUDA:
// UNSUPPORTED.
Status SetDevice(int device);

Result<void*> Malloc(uint64_t bytes);
Status Free(void* p);
Status HostRegister(void* p, uint64_t bytes);
Status HostUnregister(void* p);
// NUMA node of GPU `device` (from its PCI bus id), -1 when unknown.
int NumaNodeOfDevice(int device);

// A stream and events, for asynchronous copies. Opaque handles.
using Stream = void*;
using Event = void*;
Result<Stream> StreamCreate();
Status StreamDestroy(Stream s);
Status MemcpyAsync(void* dst, const void* src, uint64_t bytes, bool to_device, Stream s);
// Waits until everything enqueued on `s` ran; its first error, named.
Status StreamSynchronize(Stream s);
Result<Event> EventRecord(Stream s);  // creates and records
Status EventSynchronize(Event e);      // waits, then destroys the event
bool EventQuery(Event e);              // true once complete

}  // namespace strata::gpu
