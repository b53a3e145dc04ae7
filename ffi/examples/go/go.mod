module kvroute.example/route

go 1.19
