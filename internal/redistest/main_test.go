package redistest

import (
	"os"
	"testing"
)

func TestMain(m *testing.M) {
	LogToTests()
	code := m.Run()
	if code != 0 {
		UncapturedLog(os.Stderr)
	}
	os.Exit(code)
}
