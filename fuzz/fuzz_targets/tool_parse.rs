//! Reading tool calls (and harmony's channels) out of arbitrary text, in every format:
//! no panic, and the text pushed in two pieces (split at the first byte's choice) gives
//! the same events' sums as the whole: content, reasoning, and calls whose argument
//! deltas add up to the calls' arguments.
#![no_main]
use krafla::chat::calls::sum_events;
use krafla::chat::tools::{ToolEvent, ToolFormat, ToolParser};
use libfuzzer_sys::fuzz_target;

const FORMATS: [ToolFormat; 5] = [
    ToolFormat::Hermes,
    ToolFormat::Llama3Json,
    ToolFormat::MistralJson,
    ToolFormat::MistralArgs,
    ToolFormat::Harmony,
];

/// Content, reasoning and (name, arguments) of each call, as the events give them.
fn read(format: ToolFormat, pieces: &[&str]) -> (String, String, Vec<(String, String)>) {
    let mut p = ToolParser::new(format, vec!["f".into(), "get_weather".into()], true);
    let mut evs: Vec<ToolEvent> = pieces.iter().flat_map(|t| p.push(t)).collect();
    evs.extend(p.finish());
    sum_events(evs, p.calls())
}

fuzz_target!(|data: &[u8]| {
    let Some((&sel, rest)) = data.split_first() else {
        return;
    };
    let Ok(text) = std::str::from_utf8(rest) else {
        return;
    };
    let format = FORMATS[sel as usize % FORMATS.len()];
    let mut cut = (sel as usize * 7) % (text.len() + 1);
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    let whole = read(format, &[text]);
    assert_eq!(read(format, &[&text[..cut], &text[cut..]]), whole);
});
