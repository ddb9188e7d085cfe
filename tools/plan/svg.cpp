// --svg: one stacked bar per tier (device, host, NVMe, per rank), a segment
// per state, each bar on its own scale (the tiers differ by orders of
// magnitude) with the tier's capacity drawn as a dashed line across it.
#include <algorithm>
#include <cstdio>
#include <string>

#include "base/sizes.h"
#include "tools/plan/report.h"

namespace strata::plan {

namespace {

constexpr const char* kColors[kNumPlanStates] = {"#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f",
                                                 "#edc948", "#b07aa1", "#9c755f", "#ff9da7"};
constexpr double kBarTop = 70, kBarHeight = 300, kBarWidth = 110;

std::string Escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '&')
      out += "&amp;";
    else if (c == '<')
      out += "&lt;";
    else if (c == '>')
      out += "&gt;";
    else if (c == '"')
      out += "&quot;";
    else
      out += c;
  }
  return out;
}

std::string Num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", v);
  return buf;
}

std::string Text(double x, double y, const std::string& s, const char* extra = "") {
  return "<text x=\"" + Num(x) + "\" y=\"" + Num(y) + "\"" + extra + ">" + Escape(s) + "</text>\n";
}

std::string Bar(const Capacity& cap, int t, double x) {
  const auto tier = TierKind(t);
  const double used = static_cast<double>(cap.Used(tier));
  const double capacity = static_cast<double>(cap.capacity[static_cast<size_t>(t)]);
  const double full = std::max({used, capacity, 1.0});
  const double bottom = kBarTop + kBarHeight;
  std::string s =
      Text(x + kBarWidth / 2, bottom + 20, TierName(tier), " text-anchor=\"middle\" font-weight=\"bold\"");
  s += Text(x + kBarWidth / 2, bottom + 38,
            FormatBytes(cap.Used(tier)) + " of " + FormatBytes(cap.capacity[static_cast<size_t>(t)]),
            " text-anchor=\"middle\"");
  s += Text(x + kBarWidth / 2, bottom + 56, cap.Fits(tier) ? "fits" : "does not fit",
            cap.Fits(tier) ? " text-anchor=\"middle\" fill=\"#2a7a2a\""
                           : " text-anchor=\"middle\" fill=\"#c0392b\"");
  s += "<rect x=\"" + Num(x) + "\" y=\"" + Num(kBarTop) + "\" width=\"" + Num(kBarWidth) + "\" height=\"" +
       Num(kBarHeight) + "\" fill=\"#f4f4f4\" stroke=\"#cccccc\"/>\n";
  double y = bottom;
  for (int st = 0; st < kNumPlanStates; ++st) {
    const uint64_t b = cap.bytes[static_cast<size_t>(st)][static_cast<size_t>(t)];
    if (!b) continue;
    const double h = static_cast<double>(b) / full * kBarHeight;
    y -= h;
    s += "<rect x=\"" + Num(x) + "\" y=\"" + Num(y) + "\" width=\"" + Num(kBarWidth) + "\" height=\"" +
         Num(h) + "\" fill=\"" + kColors[st] + "\"><title>" +
         Escape(std::string(PlanStateName(PlanState(st))) + ": " + FormatBytes(b)) + "</title></rect>\n";
  }
  const double cy = bottom - capacity / full * kBarHeight;
  s += "<line x1=\"" + Num(x - 8) + "\" y1=\"" + Num(cy) + "\" x2=\"" + Num(x + kBarWidth + 8) + "\" y2=\"" +
       Num(cy) + "\" stroke=\"#c0392b\" stroke-width=\"2\" stroke-dasharray=\"6,3\"/>\n";
  s += Text(x + kBarWidth + 10, cy + 4, "capacity", " font-size=\"11\" fill=\"#c0392b\"");
  return s;
}

}  // namespace

std::string FormatSvg(const Report& r) {
  const double width = 760, height = 480;
  std::string s = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  s += "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + Num(width) + "\" height=\"" + Num(height) +
       "\" viewBox=\"0 0 " + Num(width) + " " + Num(height) +
       "\" font-family=\"sans-serif\" font-size=\"13\">\n";
  s += "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  const auto& z = r.config.zero;
  s += Text(20, 28,
            "strata-plan: " + r.model.name + " on " + r.cluster.name + " (world " +
                std::to_string(r.cluster.world_size()) + "), bytes per rank in each tier",
            " font-size=\"16\" font-weight=\"bold\"");
  s += Text(20, 50,
            "stage " + std::to_string(z.stage) + ", P " + OffloadDeviceName(z.offload_param.device) +
                ", W/M/V " + OffloadDeviceName(z.offload_optimizer.device) +
                "; each bar on its own scale, dashed line = capacity");
  for (int t = 0; t < kNumTiers; ++t) s += Bar(r.capacity, t, 40 + t * 190.0);
  for (int st = 0; st < kNumPlanStates; ++st) {
    const double y = kBarTop + 10 + st * 22.0;
    s += "<rect x=\"620\" y=\"" + Num(y) + "\" width=\"14\" height=\"14\" fill=\"" + kColors[st] + "\"/>\n";
    s += Text(640, y + 12, PlanStateName(PlanState(st)));
  }
  s += "</svg>\n";
  return s;
}

}  // namespace strata::plan
