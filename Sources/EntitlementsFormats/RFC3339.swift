/// RFC 3339 timestamps <-> Unix milliseconds, without Foundation's date machinery.
///
/// Parsing accepts `YYYY-MM-DDTHH:MM:SS[.fraction](Z|+HH:MM|-HH:MM)` (also a lower-case
/// `t`/`z`, as RFC 3339 allows); fractions beyond milliseconds are truncated toward the
/// past. Formatting always writes UTC with exactly three fraction digits:
/// `2026-01-31T12:00:00.000Z`.
public enum RFC3339 {
    /// The Unix milliseconds of `text`, or nil if it is not an RFC 3339 date-time.
    public static func parse(_ text: some StringProtocol) -> Int64? {
        var parser = Parser(bytes: Array(text.utf8))
        return parser.parse()
    }

    /// `milliseconds` as an RFC 3339 UTC date-time with milliseconds.
    public static func format(_ milliseconds: Int64) -> String {
        let (days, millisecondOfDay) = Self.floorDivide(milliseconds, 86_400_000)
        let (year, month, day) = Self.civil(fromDays: days)
        let hour = millisecondOfDay / 3_600_000
        let minute = millisecondOfDay / 60_000 % 60
        let second = millisecondOfDay / 1_000 % 60
        let millisecond = millisecondOfDay % 1_000
        var text = ""
        text.reserveCapacity(24)
        if year < 0 {
            text += "-"
        }
        text += Self.pad(abs(year), 4) + "-" + Self.pad(month, 2) + "-" + Self.pad(day, 2)
        text += "T" + Self.pad(hour, 2) + ":" + Self.pad(minute, 2) + ":" + Self.pad(second, 2)
        text += "." + Self.pad(millisecond, 3) + "Z"
        return text
    }

    private static func pad(_ value: Int64, _ width: Int) -> String {
        let digits = String(value)
        return digits.count >= width ? digits : String(repeating: "0", count: width - digits.count) + digits
    }

    private static func floorDivide(_ value: Int64, _ divisor: Int64) -> (Int64, Int64) {
        let quotient = value / divisor
        let remainder = value % divisor
        return remainder < 0 ? (quotient - 1, remainder + divisor) : (quotient, remainder)
    }

    /// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
    static func days(fromCivil year: Int64, _ month: Int64, _ day: Int64) -> Int64 {
        let y = month <= 2 ? year - 1 : year
        let era = (y >= 0 ? y : y - 399) / 400
        let yearOfEra = y - era * 400
        let dayOfYear = (153 * (month > 2 ? month - 3 : month + 9) + 2) / 5 + day - 1
        let dayOfEra = yearOfEra * 365 + yearOfEra / 4 - yearOfEra / 100 + dayOfYear
        return era * 146_097 + dayOfEra - 719_468
    }

    static func civil(fromDays days: Int64) -> (year: Int64, month: Int64, day: Int64) {
        let z = days + 719_468
        let era = (z >= 0 ? z : z - 146_096) / 146_097
        let dayOfEra = z - era * 146_097
        let yearOfEra = (dayOfEra - dayOfEra / 1_460 + dayOfEra / 36_524 - dayOfEra / 146_096) / 365
        let dayOfYear = dayOfEra - (365 * yearOfEra + yearOfEra / 4 - yearOfEra / 100)
        let mp = (5 * dayOfYear + 2) / 153
        let day = dayOfYear - (153 * mp + 2) / 5 + 1
        let month = mp < 10 ? mp + 3 : mp - 9
        return (yearOfEra + era * 400 + (month <= 2 ? 1 : 0), month, day)
    }

    private struct Parser {
        let bytes: [UInt8]
        var index = 0

        mutating func parse() -> Int64? {
            guard
                let year = self.digits(4), self.expect(UInt8(ascii: "-")),
                let month = self.digits(2), self.expect(UInt8(ascii: "-")),
                let day = self.digits(2), self.expect(anyOf: [UInt8(ascii: "T"), UInt8(ascii: "t")]),
                let hour = self.digits(2), self.expect(UInt8(ascii: ":")),
                let minute = self.digits(2), self.expect(UInt8(ascii: ":")),
                let second = self.digits(2)
            else {
                return nil
            }
            guard (1...12).contains(month), (1...Self.daysIn(month: month, year: year)).contains(day),
                hour <= 23, minute <= 59, second <= 60
            else {
                return nil
            }
            var millisecond: Int64 = 0
            if self.expect(UInt8(ascii: ".")) {
                var count = 0
                while self.index < self.bytes.count, let digit = Self.digit(self.bytes[self.index]) {
                    if count < 3 {
                        millisecond = millisecond * 10 + digit
                    }
                    count += 1
                    self.index += 1
                }
                guard count > 0 else {
                    return nil
                }
                for _ in count..<max(count, 3) {
                    millisecond *= 10
                }
            }
            var offsetMinutes: Int64 = 0
            if self.expect(anyOf: [UInt8(ascii: "Z"), UInt8(ascii: "z")]) {
                offsetMinutes = 0
            } else if self.index < self.bytes.count, self.bytes[self.index] == UInt8(ascii: "+") || self.bytes[self.index] == UInt8(ascii: "-") {
                let sign: Int64 = self.bytes[self.index] == UInt8(ascii: "-") ? -1 : 1
                self.index += 1
                guard let offsetHours = self.digits(2), self.expect(UInt8(ascii: ":")), let offsetMinute = self.digits(2),
                    offsetHours <= 23, offsetMinute <= 59
                else {
                    return nil
                }
                offsetMinutes = sign * (offsetHours * 60 + offsetMinute)
            } else {
                return nil
            }
            guard self.index == self.bytes.count else {
                return nil
            }
            // A leap second (:60) is read as the first instant of the next minute.
            let days = RFC3339.days(fromCivil: year, month, day)
            let seconds = days * 86_400 + hour * 3_600 + minute * 60 + second - offsetMinutes * 60
            return seconds * 1_000 + millisecond
        }

        private static func daysIn(month: Int64, year: Int64) -> Int64 {
            switch month {
            case 2: (year % 4 == 0 && year % 100 != 0) || year % 400 == 0 ? 29 : 28
            case 4, 6, 9, 11: 30
            default: 31
            }
        }

        private static func digit(_ byte: UInt8) -> Int64? {
            byte >= 0x30 && byte <= 0x39 ? Int64(byte - 0x30) : nil
        }

        private mutating func digits(_ count: Int) -> Int64? {
            guard self.index + count <= self.bytes.count else {
                return nil
            }
            var value: Int64 = 0
            for _ in 0..<count {
                guard let digit = Self.digit(self.bytes[self.index]) else {
                    return nil
                }
                value = value * 10 + digit
                self.index += 1
            }
            return value
        }

        private mutating func expect(_ byte: UInt8) -> Bool {
            self.expect(anyOf: [byte])
        }

        private mutating func expect(anyOf options: [UInt8]) -> Bool {
            guard self.index < self.bytes.count, options.contains(self.bytes[self.index]) else {
                return false
            }
            self.index += 1
            return true
        }
    }
}
