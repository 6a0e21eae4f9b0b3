//! A byte-count progress bar on stderr, hidden when stderr is not a terminal.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressStyle};

/// A progress bar for `total` bytes of output, labelled `what`.
pub fn bytes_bar(what: &str) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(0);
    let style = ProgressStyle::with_template(
        "{msg} [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} ({bytes_per_sec}, {eta})",
    )
    .unwrap_or_else(|_| ProgressStyle::default_bar());
    bar.set_style(style);
    bar.set_message(what.to_string());
    bar
}

/// Adapts a bar to the `(bytes just written, total)` callbacks of the synth and quantize
/// library functions.
pub fn callback(bar: &ProgressBar) -> impl FnMut(u64, u64) + '_ {
    move |bytes, total| {
        if bar.length() != Some(total) {
            bar.set_length(total);
        }
        bar.inc(bytes);
    }
}
