; Inno Setup 6 script for Polis (Windows x64). build.py runs it as:
;   iscc /DAppVersion=0.1.0 /DSourceDir=<dist\bundle\Polis> /DOutputDir=<dist> /DIconFile=<resources\icons\polis.ico>
;        /DOutputName=Polis-0.1.0-windows-x64-setup installer\windows\polis.iss
; Installs per user by default (no administrator rights needed; the user may choose all users),
; adds a Start menu entry (and optionally a desktop shortcut), and on uninstall removes the
; "start at login" entry the app may have written. User data (%LOCALAPPDATA%\Polis) is left alone.

#ifndef AppVersion
  #define AppVersion "0.0.0"
#endif
#ifndef SourceDir
  #define SourceDir "..\..\dist\bundle\Polis"
#endif
#ifndef OutputDir
  #define OutputDir "..\..\dist"
#endif
#ifndef IconFile
  #define IconFile "..\..\resources\icons\polis.ico"
#endif
#ifndef OutputName
  #define OutputName "Polis-" + AppVersion + "-windows-x64-setup"
#endif

[Setup]
AppId={{6C1F4E0B-7A52-4C8E-9D3B-2F5A9E1C7B40}
AppName=Polis
AppVersion={#AppVersion}
AppVerName=Polis {#AppVersion}
AppPublisher=Polis contributors
VersionInfoVersion={#AppVersion}
DefaultDirName={autopf}\Polis
DefaultGroupName=Polis
DisableProgramGroupPage=yes
PrivilegesRequired=lowest
PrivilegesRequiredOverridesAllowed=dialog
ArchitecturesAllowed=x64compatible
ArchitecturesInstallIn64BitMode=x64compatible
OutputDir={#OutputDir}
OutputBaseFilename={#OutputName}
SetupIconFile={#IconFile}
UninstallDisplayIcon={app}\Polis.exe
UninstallDisplayName=Polis
Compression=lzma2
SolidCompression=yes
WizardStyle=modern
CloseApplications=yes

[Languages]
Name: "english"; MessagesFile: "compiler:Default.isl"

[Tasks]
Name: "desktopicon"; Description: "{cm:CreateDesktopIcon}"; GroupDescription: "{cm:AdditionalIcons}"; Flags: unchecked

[Files]
Source: "{#SourceDir}\*"; DestDir: "{app}"; Flags: ignoreversion recursesubdirs createallsubdirs

[Icons]
Name: "{autoprograms}\Polis"; Filename: "{app}\Polis.exe"
Name: "{autodesktop}\Polis"; Filename: "{app}\Polis.exe"; Tasks: desktopicon

[Registry]
; written by the app's "start at login" setting (app/autostart.py); only removed here, never created
Root: HKCU; Subkey: "Software\Microsoft\Windows\CurrentVersion\Run"; ValueType: none; ValueName: "Polis"; Flags: uninsdeletevalue

[Run]
Filename: "{app}\Polis.exe"; Description: "{cm:LaunchProgram,Polis}"; Flags: nowait postinstall skipifsilent
