/// The instant the cache tests answer at: 2026-11-22T00:00:00Z.
let now: Int64 = 1_795_305_600_000
let day: Int64 = 86_400_000
