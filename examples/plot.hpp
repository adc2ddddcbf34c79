#pragma once
// --plot DIR: the run as pictures, plain SVG 1.1 that browsers and rsvg-convert render. loss.svg is the
// training loss per step (and validation points); memory.svg is each device's peak memory, the simulator's
// prediction stacked by kind next to the measured total.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

namespace plot {

struct Series {
  std::string name, color;
  std::vector<std::pair<double, double>> points;
  bool markers = false;  // dots instead of a line
};

// One bar of a bar chart: stacked segments (label, value, color) from the bottom.
struct Bar {
  std::string label;
  std::vector<std::tuple<std::string, double, std::string>> segments;
};

namespace detail {

constexpr double width = 640, height = 400, left = 70, right = 170, top = 45, bottom = 50;

inline std::string num(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4g", x);
  return buf;
}
inline std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) out += c == '<' ? "&lt;" : c == '>' ? "&gt;" : c == '&' ? "&amp;" : std::string(1, c);
  return out;
}
// A tick step of 1, 2 or 5 times a power of ten giving about `ticks` steps over `span`.
inline double nice_step(double span, int ticks) {
  const double raw = span / ticks, unit = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0})
    if (raw <= m * unit) return m * unit;
  return 10 * unit;
}
// The title, and a smaller subtitle under it (e.g. the run's mesh and schedule).
inline std::string header(const std::string& title, const std::string& subtitle) {
  return "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + num(width) + "\" height=\"" + num(height) +
         "\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
         "<text x=\"" + num(width / 2) + "\" y=\"18\" text-anchor=\"middle\" font-size=\"15\">" + escape(title) +
         "</text>\n<text x=\"" + num(width / 2) + "\" y=\"33\" text-anchor=\"middle\" font-size=\"10\" fill=\"#555\">" +
         escape(subtitle) + "</text>\n";
}
inline std::string text(double x, double y, const std::string& s, const char* anchor = "start") {
  return "<text x=\"" + num(x) + "\" y=\"" + num(y) + "\" text-anchor=\"" + anchor + "\">" + escape(s) + "</text>\n";
}
inline double y_linear(double v, double lo, double hi) {
  return height - bottom - (v - lo) / (hi - lo) * (height - bottom - top);
}
// Axes with ticks every `step` on y from lo to hi, and the axis titles.
inline std::string axes(double lo, double hi, double step, const std::string& x_title, const std::string& y_title) {
  const double x0 = left, x1 = width - right, y0 = height - bottom;
  std::string s = "<path d=\"M" + num(x0) + " " + num(top) + " V" + num(y0) + " H" + num(x1) +
                  "\" stroke=\"black\" fill=\"none\"/>\n";
  for (double v = lo; v <= hi + step / 2; v += step) {
    const double y = y_linear(v, lo, hi);
    s += "<path d=\"M" + num(x0 - 4) + " " + num(y) + " H" + num(x1) + "\" stroke=\"#ddd\"/>\n";
    s += text(x0 - 6, y + 4, num(v), "end");
  }
  s += text((x0 + x1) / 2, height - 12, x_title, "middle");
  s += "<text transform=\"translate(16 " + num((top + y0) / 2) + ") rotate(-90)\" text-anchor=\"middle\">" +
       escape(y_title) + "</text>\n";
  return s;
}
inline std::string legend_entry(int i, const std::string& name, const std::string& color) {
  const double x = width - right + 14, y = top + 18.0 * i;
  return "<rect x=\"" + num(x) + "\" y=\"" + num(y) + "\" width=\"12\" height=\"12\" fill=\"" + color + "\"/>\n" +
         text(x + 18, y + 10, name);
}
inline void write(const std::filesystem::path& path, const std::string& svg) {
  std::ofstream f(path);
  f << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n" << svg << "</svg>\n";
  if (!f) throw std::runtime_error("cannot write " + path.string());
}

}  // namespace detail

// A line chart of the series; y starts at 0 when every value is positive.
inline void line_chart(const std::filesystem::path& path, const std::string& title, const std::string& subtitle,
                       const std::string& x_title, const std::string& y_title, const std::vector<Series>& series) {
  using namespace detail;
  double x_lo = INFINITY, x_hi = -INFINITY, y_lo = 0, y_hi = -INFINITY;
  for (const auto& s : series)
    for (auto [x, y] : s.points) x_lo = std::min(x_lo, x), x_hi = std::max(x_hi, x), y_lo = std::min(y_lo, y), y_hi = std::max(y_hi, y);
  if (!(x_hi > x_lo)) x_lo = std::isfinite(x_lo) ? x_lo : 0, x_hi = x_lo + 1;
  if (!(y_hi > y_lo)) y_hi = y_lo + 1;
  const double y_step = nice_step(y_hi - y_lo, 5), x_step = nice_step(x_hi - x_lo, 5);
  y_lo = std::floor(y_lo / y_step) * y_step, y_hi = std::ceil(y_hi / y_step) * y_step;
  auto x_of = [&](double x) { return left + (x - x_lo) / (x_hi - x_lo) * (width - right - left); };
  std::string svg = header(title, subtitle) + axes(y_lo, y_hi, y_step, x_title, y_title);
  for (double x = std::ceil(x_lo / x_step) * x_step; x <= x_hi; x += x_step)
    svg += text(x_of(x), height - bottom + 16, num(x), "middle");
  for (std::size_t i = 0; i < series.size(); ++i) {
    const Series& s = series[i];
    if (s.markers) {
      for (auto [x, y] : s.points)
        svg += "<circle cx=\"" + num(x_of(x)) + "\" cy=\"" + num(y_linear(y, y_lo, y_hi)) + "\" r=\"4\" fill=\"" + s.color + "\"/>\n";
    } else if (!s.points.empty()) {
      svg += "<polyline fill=\"none\" stroke-width=\"1.5\" stroke=\"" + s.color + "\" points=\"";
      for (auto [x, y] : s.points) svg += num(x_of(x)) + "," + num(y_linear(y, y_lo, y_hi)) + " ";
      svg += "\"/>\n";
    }
    svg += legend_entry(static_cast<int>(i), s.name, s.color);
  }
  write(path, svg);
}

// Bars side by side, each a stack of segments; the legend lists each segment label once.
inline void bar_chart(const std::filesystem::path& path, const std::string& title, const std::string& subtitle,
                      const std::string& y_title, const std::vector<Bar>& bars) {
  using namespace detail;
  double hi = 0;
  for (const auto& b : bars) {
    double sum = 0;
    for (const auto& [label, v, color] : b.segments) sum += v;
    hi = std::max(hi, sum);
  }
  const double step = nice_step(hi > 0 ? hi : 1, 5);
  hi = std::max(1.0, std::ceil(hi / step)) * step;
  std::string svg = header(title, subtitle) + axes(0, hi, step, "", y_title);
  const double slot = (width - right - left) / static_cast<double>(std::max<std::size_t>(1, bars.size()));
  std::vector<std::string> legend;
  for (std::size_t i = 0; i < bars.size(); ++i) {
    const double x = left + slot * (static_cast<double>(i) + 0.15);
    double base = 0;
    for (const auto& [label, v, color] : bars[i].segments) {
      const double y_top = y_linear(base + v, 0, hi), y_bottom = y_linear(base, 0, hi);
      svg += "<rect x=\"" + num(x) + "\" y=\"" + num(y_top) + "\" width=\"" + num(slot * 0.7) + "\" height=\"" +
             num(y_bottom - y_top) + "\" fill=\"" + color + "\"><title>" + escape(label) + ": " + num(v) +
             "</title></rect>\n";
      base += v;
      if (std::find(legend.begin(), legend.end(), label) == legend.end()) {
        svg += legend_entry(static_cast<int>(legend.size()), label, color);
        legend.push_back(label);
      }
    }
    svg += text(x + slot * 0.35, height - bottom + 16, bars[i].label, "middle");
  }
  write(path, svg);
}

}  // namespace plot
