#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tether_fuzz::Target::DataLink.fuzz(data));
